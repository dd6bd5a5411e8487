"""fork_frac of real OpenCode rollouts, before and after pinning the chat template, per way the model writes a turn.

Each conversation is the pinned OpenCode client running one task (a bash call, its result, a final message)
through openenv's real capture proxy against the LFM2.5 engine double (vLLM's own request and tool-call code,
the tiny LFM2 model; tests/opencode_rollout.py), chained by TRL 1.15's `_chain_to_sequences` with
`fork_threshold_tokens=0`. `fork_frac` is TRL's `rollout/fork_frac` (forked transitions / transitions); rows per
rollout is TRL's `rollout/samples_per_rollout`. "model repo's" is the template serve_policy.sh left vLLM before
(the model folder's own, here the stand-in that opens `<think>`); "pinned" is chat_template.py's, via
serve_policy.sh. Each style is one way a model may write its tool-call turn; only the template's own format
round-trips, the others are what remains after the fix.

    OMP_NUM_THREADS=1 python benchmarks/fork_frac.py --conversations 2      # ~15 min on 2 busy cores
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from opencode_rollout import (  # noqa: E402
    CANONICAL,
    chain,
    rollout_stack,
    run_opencode,
    tiny_model_with_hub_template,
)

CALL = "[bash(command='wc -l data.csv', description='Count lines')]"
STYLES = {
    "template's own format": CANONICAL,
    "text, newline, call": ["I will count the lines.\n<|tool_call_start|>" + CALL + "<|tool_call_end|>", CANONICAL[1]],
    "call, then text": ["<|tool_call_start|>" + CALL + "<|tool_call_end|>Counting the lines.", CANONICAL[1]],
    "double-quoted args": ['<|tool_call_start|>[bash(command="wc -l data.csv", description="Count lines")]'
                           "<|tool_call_end|>", CANONICAL[1]],
}


def measure(pinned: bool, conversations: int, tmp: Path) -> list[dict]:
    rows = []
    model = tiny_model_with_hub_template(tmp / "model")
    script = tmp / "stack" / "script.json"
    with rollout_stack(model, CANONICAL, tmp / "stack", pinned=pinned) as stack:
        for style, turns in STYLES.items():
            script.write_text(json.dumps(turns))
            forks = transitions = samples = 0.0
            for n in range(conversations):
                rows_, tally = chain(run_opencode(stack, tmp / f"work-{len(rows)}-{n}"))
                forks, transitions, samples = forks + tally["fork"], transitions + tally["transitions"], \
                    samples + len(rows_)
            rows.append({"template": "pinned" if pinned else "model repo's", "style": style,
                         "rollouts": conversations, "transitions": int(transitions), "forks": int(forks),
                         "fork_frac": forks / transitions if transitions else 0.0,
                         "rows_per_rollout": samples / conversations})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2, help="OpenCode rollouts per template and style")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    start = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fork-frac-") as tmp:
        for pinned in (False, True):
            rows += measure(pinned, args.conversations, Path(tmp) / ("pinned" if pinned else "repo"))
    print("| template | assistant turn written as | rollouts | transitions | forks | fork_frac | rows/rollout |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['template']} | {r['style']} | {r['rollouts']} | {r['transitions']} | {r['forks']} "
              f"| {r['fork_frac']:.2f} | {r['rows_per_rollout']:.2f} |")
    print(f"\n{time.monotonic() - start:.0f} s; command: OMP_NUM_THREADS=1 python benchmarks/fork_frac.py "
          f"--conversations {args.conversations}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
