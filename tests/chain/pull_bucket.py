"""Copy this task's files from its data bucket into /home/user/input (the puller the task image ships).

The suite's stand-in for the dataset's bucket puller: it lists `BUCKET_PREFIX` in `HF_BUCKET` at `HF_ENDPOINT`
(the suite's loopback bucket, tests/chain/bucket.py) and downloads every file. Standard library only: it runs
in the task image's python3.
"""
import json
import os
import pathlib
import urllib.parse
import urllib.request

endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
bucket, prefix = os.environ["HF_BUCKET"], os.environ["BUCKET_PREFIX"]
base = f"{endpoint}/buckets/{bucket}"
target = pathlib.Path("/home/user/input")
target.mkdir(parents=True, exist_ok=True)
with urllib.request.urlopen(f"{base}/tree/{urllib.parse.quote(prefix)}", timeout=30) as listing:
    names = json.load(listing)
for name in names:
    with urllib.request.urlopen(f"{base}/resolve/{urllib.parse.quote(prefix)}/{urllib.parse.quote(name)}",
                                timeout=60) as response:
        (target / pathlib.Path(name).name).write_bytes(response.read())
print("staged", len(names), "files from", bucket, prefix)
