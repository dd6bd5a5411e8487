"""The one chat template vLLM renders prompts with and the trainer's tokenizer carries: TRL 1.15's LFM2.5 template,
checked prefix-stable at start-up, since a template that renders a turn back differently forks every rollout into
several training rows (docs/training.md, The chat template).

    python chat_template.py FILE     # write the checked template to FILE (serve_policy.sh: vLLM's --chat-template)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

TRL_TEMPLATE_FILE = "lfm2_2_5.jinja"  # the file behind trl.chat_template_utils.lfm2_2_5_chat_template
GENERATION_PROMPT = "<|im_start|>assistant\n"
END = "<|im_end|>"
# Assistant turns as OpenCode sends them back (vLLM's lfm2 parser split the sampled text into content and tool_calls,
# the arguments a dict), each with the text LFM2.5 sampled for it.
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
            f"the chat template's generation prompt ends {prompt[-40:]!r}, not {GENERATION_PROMPT!r}: whatever it "
            "opens there (e.g. <think>) is in the sampled prompt but in no assistant turn rendered back, so every "
            "turn after the first would fork a new training row; use TRL 1.15's lfm2_2_5_chat_template")
    for message, sampled in TURNS:
        rendered = render([*history, message, {"role": "tool", "content": "3 data.csv"}])
        if not rendered.startswith(prompt + sampled + END):
            back = rendered[len(prompt) - 20 :][:160]
            raise ChatTemplateError(
                f"the chat template renders the assistant turn {sampled!r} back as {back!r}: the next prompt would "
                "not extend the sampled tokens and TRL would fork the rollout into a new row")


def template_text() -> str:
    """TRL's template file, found without importing trl (a minute of CPU on a loaded machine, on serve_policy.sh's
    path to vLLM's start)."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise ChatTemplateError("trl is not installed: install the recipe's pins (`python3 recipe.py --requirements`; "
                                "trl 1.15.0 ships the template)")
    path = Path(next(iter(spec.submodule_search_locations))) / "chat_templates" / TRL_TEMPLATE_FILE
    if not path.is_file():
        raise ChatTemplateError(f"trl has no chat_templates/{TRL_TEMPLATE_FILE}: install the recipe's trl "
                                "(recipe.JOB_REQUIREMENTS)")
    return path.read_text(encoding="utf-8")


def chat_template() -> str:
    """TRL 1.15's LFM2.5 chat template, checked prefix-stable."""
    text = template_text()
    check(text)
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
