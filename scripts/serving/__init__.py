"""Load against a running cluster: `bench_serving` (one workload, its figures; `pdserve-bench`),
`soak` (hours of steady load, growth judged), `admission_limit`, `structured_check`.

client: one streamed request -> a `RequestTrace`; benchmark: one run from frozen configs; report:
table, JSON and plots; workers, procstat, node_metrics: client processes and what they watch;
probes, growth and soak_report: what the soak samples and how it judges.
"""
