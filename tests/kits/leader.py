"""The process the launcher tests start on a host (ssh rig, Slurm rig)."""

from __future__ import annotations

# A leader that prints, then starts a child which leaves its session (as vLLM's engine does not, but a
# stray could): only the marker then ties the child to the leader.
LEADER = ("import os, subprocess, sys, time\n"
          "print('hello from', os.environ['HOSTNAME_TAG'], flush=True)\n"
          "subprocess.Popen([sys.executable, '-c', 'import os,time; os.setsid(); time.sleep(600)'])\n"
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
          "time.sleep(600)\n")
