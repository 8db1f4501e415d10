"""What the tests share (no test module imports another; tests/unit/test_layers.py checks it):

ports.py            free loopback ports (free_ports, port_free, consecutive_free, free_port)
waits.py            polling until something holds (wait_for, wait_value)
cli_runner.py       `pdserve` as a subprocess, status --json, configs on fake servers, a cluster's marked processes
spec_data.py        specs for the pure tests: GOOD, with_/DELETE, TWO_HOSTS, plan_of, arg
metric_text.py      reading the router's /metrics text (sample, reuse_hits)
fake_vllm.py        a fake vLLM OpenAI server (in-process app or its own process), with fake_agent_wire.py
                    (/v1/messages, /v1/responses) and hostile.py (what vLLM never sends)
fake_supervision.py the supervisor's fakes (launcher, clock, executor, probes, canary)
supervisor_rig.py   the supervisor on those fakes, driven tick by tick (Rig)
router_rig.py       the router and fake backends in-process on free ports (deployment)
redis_rig.py        a real redis-server, a reuse store on it (store_at, PARAMS), more router replicas
raw_server.py       a raw asyncio server with one scripted answer per request (misbehaving backends)
wire_samples.py     sample answers and streams of the wire formats (Anthropic Messages, OpenAI Responses)
otlp_receiver.py    an OTLP/HTTP traces receiver
netns_rig.py        two "hosts" in network namespaces, each with sshd; a plan on them (cluster)
slurm_rig.py        a one-node Slurm on this machine
leader.py           the process the launcher tests start on a host (LEADER)

Fixtures more than one test package uses are in tests/conftest.py; a package's own in its conftest.py.
"""
