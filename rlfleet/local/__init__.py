"""The one-machine runtime behind `rlfleet run`: every component as an OS process on this machine.

launcher.py      the run: builds the model once, starts Redis and every component, waits, reports
plan.py          the run's processes as typed records (component, ports, pool...), their argv built last
supervisor.py    processes under a restart policy with back-off, as kubelet runs a pod's containers
redis_server.py  the embedded `redis-server` (a free loopback port, its own data directory)
progress.py      what the terminal shows while a run starts and trains
run_report.py    `rlfleet report`: RUN_DIR/report/index.html and its PNGs from the run directory
prometheus.py    the run's scrape targets (Prometheus file_sd) and `rlfleet run --prometheus`
Nothing outside this package imports it except the command line: the components never know
whether they run here or in a pod.
"""
