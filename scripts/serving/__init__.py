"""Load against a running cluster: `bench_serving` (one workload, its figures; `pdserve-bench`),
`soak` (hours of steady load, growth judged), `structured_check`.

The load model they share with the planner lives in planner/ (datasets: what to send; arrivals:
when; metrics: traces -> the figures). Here: client: one streamed request -> a `RequestTrace`;
load: concurrency; benchmark: one run from frozen configs; report: table, JSON and plots;
workers, procstat, node_metrics: client processes and what they watch; probes, growth and
soak_report: what the soak samples and how it judges.
"""
