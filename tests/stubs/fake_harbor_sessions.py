"""Stands in for harbor_sessions.py in run_job.sh tests: `check` is recorded, and with STUB_OPENENV=old it fails
the way the real check does on an openenv whose sessions TRL cannot train (one line, exit 1)."""
import os
import sys

with open(os.environ.get("STUB_LOG", os.devnull), "a") as log:
    print("harbor_sessions " + " ".join(sys.argv[1:]), file=log)
if os.environ.get("STUB_OPENENV") == "old":
    sys.exit("harbor_sessions: openenv 0.9.0 does not carry what harbor_sessions.py needs (TrainableSession: False): "
             "install the recipe's pinned openenv")
print("harbor_sessions: sessions are trainable on openenv 0.10.0")
