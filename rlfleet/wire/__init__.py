"""What connects the processes of a run: the contracts every component shares, whatever runs it.

streams.py     every Redis key of a run and the versioned messages on its streams
redis_acl.py   the Redis ACL user of each role: the commands and keys a component may use
runtime.py     what every component process does first: config, Redis, logging, metrics, signals
env.py         every environment variable rlfleet reads or sets
topology.py    the relay tree: which node each tier pulls from and each pool downloads from
asgi.py        an HTTP app served from a thread of a component process
ports.py       free TCP ports for the servers a run starts, outside the range outgoing connections take
run_summary.py a run's summary and reward plot, computed from the trainer's metrics.jsonl
Nothing here imports a service, the operator or the local runtime. The rules the fleet's work follows
(reputation, assignment, repeats, the prompt filter, the async window) are in rlfleet/fleet/.
"""
