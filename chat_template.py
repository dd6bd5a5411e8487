"""The one chat template vLLM serves and the trainer's tokenizer carries: TRL 1.15's LFM2.5 template, checked
prefix-stable (one that renders a turn back differently forks every rollout: docs/training.md, The chat template).

    python chat_template.py FILE     # write the checked template to FILE (serve_policy.sh: vLLM's --chat-template)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

TRL_TEMPLATE_FILE = "lfm2_2_5.jinja"  # the file behind trl.chat_template_utils.lfm2_2_5_chat_template
GENERATION_PROMPT = "<|im_start|>assistant\n"
# Assistant turns as OpenCode sends them back (vLLM's lfm2 parser split them, arguments a dict), and what was sampled.
TURNS = (
    ({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "bash", "arguments": {"command": "wc -l data.csv", "description": "Count lines"}}}]},
     "<|tool_call_start|>[bash(command='wc -l data.csv', description='Count lines')]<|tool_call_end|>"),
    ({"role": "assistant", "content": "Reading it first.", "tool_calls": [{"type": "function", "function": {
        "name": "read", "arguments": {"filePath": "data.csv", "limit": 10}}}]},
     "Reading it first.<|tool_call_start|>[read(filePath='data.csv', limit=10)]<|tool_call_end|>"),
    ({"role": "assistant", "content": "It has 2 rows."}, "It has 2 rows."),
)


class ChatTemplateError(RuntimeError):
    """The template would fork rollouts into several training rows."""


def check(template: str) -> None:
    """Raise ChatTemplateError unless `template` renders each agent turn back as the text that was sampled for it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(messages: list[dict]) -> str:
        return render_jinja_template(conversations=[messages], chat_template=template, bos_token="<|startoftext|>",
                                     add_generation_prompt=True)[0][0]

    history = [{"role": "system", "content": "Coding agent."}, {"role": "user", "content": "How many rows?"}]
    prompt = render(history)
    if not prompt.endswith(GENERATION_PROMPT):
        raise ChatTemplateError(
            f"the chat template's generation prompt ends {prompt[-40:]!r}, not {GENERATION_PROMPT!r}: what it opens "
            "there (e.g. <think>) is in no assistant turn rendered back, so every turn after the first would fork a "
            "new training row; use TRL 1.15's lfm2_2_5_chat_template")
    for message, sampled in TURNS:
        rendered = render([*history, message, {"role": "tool", "content": "3 data.csv"}])
        if not rendered.startswith(f"{prompt}{sampled}<|im_end|>"):
            back = rendered[len(prompt) - 20 :][:160]
            raise ChatTemplateError(
                f"the chat template renders the assistant turn {sampled!r} back as {back!r}: the next prompt would "
                "not extend the sampled tokens and TRL would fork the rollout into a new row")


def template_text() -> str:
    """TRL's template file, found without importing trl (a minute of CPU, on serve_policy.sh's path to vLLM)."""
    spec = importlib.util.find_spec("trl")
    folders = spec.submodule_search_locations if spec else None
    path = Path(next(iter(folders)), "chat_templates", TRL_TEMPLATE_FILE) if folders else None
    if path is None or not path.is_file():
        raise ChatTemplateError(f"no trl with chat_templates/{TRL_TEMPLATE_FILE}: install the recipe's pins "
                                "(`python3 recipe.py --requirements`; trl 1.15.0 ships the template)")
    return path.read_text(encoding="utf-8")


def chat_template() -> str:
    """TRL 1.15's LFM2.5 chat template, checked prefix-stable."""
    check(text := template_text())
    return text


def main(argv: list[str]) -> int:
    """`chat_template.py FILE`: write the checked template to FILE (argparse: `--help` is help, not a file name)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path, help="where to write the template (vLLM's --chat-template)")
    out = parser.parse_args(argv).file
    try:
        text = chat_template()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except (ChatTemplateError, OSError) as exc:
        print(f"chat_template.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
