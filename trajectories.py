"""What the agent did: a few trajectories kept with each checkpoint, and trajectories.html, a page of them beside the
learning curve (in the adapter repo: it needs no dashboard and outlives the job; docs/evaluation.md, "Trajectories")."""

from __future__ import annotations

import html
import json
import re
import time
from typing import Any

import adapter_repo
import recipe

PAGE_PATH = "trajectories.html"
# Characters of a message kept (head and tail): OpenCode's system prompt is ~10k, a tool's output can be 100k+.
SYSTEM_CHARS, TEXT_CHARS, ARGUMENT_CHARS = 600, 1500, 800
MESSAGES_KEPT = 70  # the first 6 and the last 64 of a longer conversation (32 agent calls are ~66 messages)
_SAMPLE = re.compile(rf"^{adapter_repo.LOGS_DIR}/([^/]+)/trajectories/({recipe.CHECKPOINT_PATTERN})\.json$")
_TRAIN_LOG = re.compile(rf"^{adapter_repo.LOGS_DIR}/([^/]+)/{re.escape(recipe.TRAIN_LOG_NAME)}$")


def clip(text: Any, limit: int) -> str:
    """`text` within `limit` characters: its head and tail, and how much was cut between them."""
    text = text if isinstance(text, str) else json.dumps(text)
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[len(text) - (limit - head):]}"


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """One message for reading: its role, its text (a string or OpenAI's text parts) clipped, its tool calls."""
    role, text = str(message.get("role", "")), message.get("content") or ""
    if isinstance(text, list):
        text = "\n".join(str(p.get("text", "")) for p in text if isinstance(p, dict) and p.get("text"))
    calls = [c.get("function") or c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    return {"role": role, "text": clip(str(text), SYSTEM_CHARS if role == "system" else TEXT_CHARS),
            "tool_calls": [{"name": str(c.get("name", "")), "arguments": clip(c.get("arguments", ""), ARGUMENT_CHARS)}
                           for c in calls]}


def trajectory(result: Any, *, task: str | None, reward: float | None, tool_calls: int) -> dict[str, Any]:
    """One finished rollout for reading, from OpenEnv's HarborRolloutResult (read by attribute): its agent
    conversation(s) as captured (auxiliary calls such as OpenCode's title call left out), and Harbor's verdict."""
    messages = [m for c in getattr(result, "conversations", None) or [] if c.role == "agent" for m in c.messages]
    if len(messages) > MESSAGES_KEPT:
        cut = len(messages) - MESSAGES_KEPT
        messages = [*messages[:6], {"role": "note", "content": f"[... {cut} messages cut ...]"},
                    *messages[len(messages) - (MESSAGES_KEPT - 6):]]
    graded = recipe.graded_reward(result)
    return {"task": task, "reward": reward if reward is not None else graded, "tool_calls": tool_calls,
            "verdict": "no grade" if graded is None else "correct" if graded > 0 else "wrong",
            "error": clip(getattr(result, "error", None) or "", 300), "at": time.time(),
            "messages": [_message(m) for m in messages]}


# --- the page --------------------------------------------------------------------------------------------------------
def repo_docs(api: Any, repo_id: str, revision: str | None = None) -> dict[str, Any]:
    """From the repo: {"train_logs": {job: doc}, "samples": {checkpoint: [trajectory]}, "summary": the watcher's}."""
    docs: dict[str, Any] = {"train_logs": {}, "samples": {}, "summary": None}
    for path in api.list_repo_files(repo_id, revision=revision):
        if match := _TRAIN_LOG.match(path):
            docs["train_logs"][match.group(1)] = adapter_repo.read_json(api, repo_id, path, revision)
        elif match := _SAMPLE.match(path):
            docs["samples"][match.group(2)] = adapter_repo.read_json(api, repo_id, path, revision)
        elif path == adapter_repo.SUMMARY_PATH:
            docs["summary"] = adapter_repo.read_json(api, repo_id, path, revision)
    return docs


def _curve(train_logs: dict[str, Any], summary: dict[str, Any] | None) -> str:
    """An SVG: the training reward per step (line), the watcher's pass@1 per checkpoint (dots), the base's (dashed)."""
    rewards = sorted({row["step"]: row["reward"] for doc in train_logs.values() for row in (doc or {}).get("logs", [])
                      if isinstance(row.get("reward"), int | float)}.items())
    evals = [(r["step"], r["pass_at_1"]) for r in (summary or {}).get("checkpoints", [])
             if r.get("complete") and r.get("pass_at_1") is not None]
    base = ((summary or {}).get("base") or {}).get("pass_at_1")
    width, height, pad = 760, 260, 40
    last, top = max([1, *(s for s, _ in rewards + evals)]), max([1.0, *(v for _, v in rewards)])

    def x(step: float) -> float:
        return round(pad + step / last * (width - 2 * pad), 1)

    def y(value: float) -> float:
        return round(height - pad - value / top * (height - 2 * pad), 1)

    dots = "".join(f'<circle class="pass" r="5" cx="{x(s)}" cy="{y(v)}"><title>step {s}: pass@1 {v:.2f}</title>'
                   "</circle>" for s, v in evals)
    if base is not None:
        dots += (f'<line class="base" x1="{pad}" x2="{width - pad}" y1="{y(base)}" y2="{y(base)}"><title>base model: '
                 f"pass@1 {base:.2f}</title></line>")
    return (f'<svg id="curve" width="{width}" height="{height}" role="img" aria-label="learning curve">'
            f'<rect x="{pad}" y="{pad}" width="{width - 2 * pad}" height="{height - 2 * pad}" class="frame"/>'
            f'<text x="{pad}" y="{pad - 8}">reward / pass@1 (0-{top:g}) against step (0-{last})</text>'
            f'<polyline class="reward" points="{" ".join(f"{x(s)},{y(v)}" for s, v in rewards)}"/>{dots}</svg>')


def _trajectory_html(t: dict[str, Any]) -> str:
    e = html.escape
    reward = "-" if t.get("reward") is None else f"{t['reward']:g}"
    head = (f"{e(str(t.get('task')))}: {e(t['verdict'])}, reward {reward}, {t.get('tool_calls', 0)} tool calls, "
            f"{e(str(t.get('outcome')))}")
    body = [f'<p class="error">{e(t["error"])}</p>'] if t.get("error") else []
    for m in t.get("messages", []):
        calls = "".join(f'<pre class="call">{e(c["name"])}({e(c["arguments"])})</pre>' for c in m.get("tool_calls", []))
        body.append(f'<div class="msg {e(m["role"])}"><b>{e(m["role"])}</b><pre>{e(m["text"])}</pre>{calls}</div>')
    return f'<details class="trajectory"><summary>{head}</summary>{"".join(body)}</details>'


def page(repo_id: str, docs: dict[str, Any]) -> str:
    """The page: the curve, then per checkpoint (newest first) its pass@1 and its trajectories, folded."""
    e = html.escape
    rows = {r["checkpoint"]: r for r in (docs.get("summary") or {}).get("checkpoints", [])}
    sections = []
    for name, sample in sorted(docs["samples"].items(), key=lambda kv: int(kv[0].rsplit("-", 1)[-1]), reverse=True):
        row = rows.get(name) or {}
        said = (f"pass@1 {row['pass_at_1']:.2f} on {row.get('scored', '?')} scored tasks" if row.get("complete")
                and row.get("pass_at_1") is not None else "not evaluated by the watcher yet")
        sections.append(f'<section id="{e(name)}"><h2>{e(name)}: {said}</h2>'
                        + "".join(_trajectory_html(t) for t in sample or []) + "</section>")
    style = ("body{font-family:sans-serif;max-width:60em;margin:auto}pre{white-space:pre-wrap;margin:.2em 0}"
             ".frame{fill:none;stroke:#999}.reward{fill:none;stroke:#36c}.pass{fill:#c33}.base{stroke:#999;"
             "stroke-dasharray:6}.msg{border-left:3px solid #ccc;padding-left:.5em}.call{color:#36c}.error{color:#c33}")
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>{e(repo_id)}: what the agent did</title>'
            f"<style>{style}</style></head><body><h1>{e(repo_id)}: what the agent did</h1>"
            "<p>Blue: the training reward per step. Red dots: the eval watcher's pass@1 per checkpoint; dashed: the "
            "base model's. Below, per checkpoint, the last rollouts before it was pushed: open one to read it.</p>"
            f"{_curve(docs['train_logs'], docs.get('summary'))}{''.join(sections)}</body></html>")

