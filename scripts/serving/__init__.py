"""Load against a running cluster: `bench_serving` (one workload, its figures), `soak` (hours of
steady load, growth judged), `admission_limit`, `hostile_probe` (hostile clients, issue 25;
`sink` its baseline), `cycle_check` (garbage in reference cycles), and the pieces they and
scripts/planning share.

datasets: what to send; client: one streamed request -> a `RequestTrace`; load: arrivals and
concurrency; metrics: traces -> the figures; report: table, JSON and plots; probes, growth and
soak_report: what the soak samples and how it judges.
"""
