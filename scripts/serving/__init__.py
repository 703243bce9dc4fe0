"""Load-testing pieces shared by bench_serving.py, tune_ratio.py and plan_capacity.py.

datasets: what to send; client: one streamed request -> a `RequestTrace`; load: arrivals and
concurrency; metrics: traces -> the figures; report: table, JSON and plots.
"""
