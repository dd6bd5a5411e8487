"""The one chat template vLLM renders prompts with and the trainer's tokenizer carries: TRL 1.15's LFM2.5 template.

Why it is pinned. Lossless capture trains a rollout as one row only while every turn's prompt, as vLLM renders it
from the messages OpenCode sends back, starts with the previous turn's prompt plus the tokens sampled for it: TRL
1.15's `_chain_to_sequences` runs with `fork_threshold_tokens=0`, so any difference starts a new row, and the
trainer counts rows, not rollouts, toward a step. The model repo's own template is not one TRL recognizes (its
`add_response_schema` refuses it) and, as the recipe's lineage found, opens `<think>` in the generation prompt
even for a non-thinking run; no assistant turn rendered back from OpenCode's messages repeats that opening, so
every turn after the first forked. TRL's `lfm2_2_5_chat_template` is the LFM2.5 generation's released template
(the one `lfm2_2_5_template` parses), opens nothing after `<|im_start|>assistant\\n`, and renders an assistant
turn back exactly as it reads it. `check` proves that on the text itself, so a TRL upgrade that changes it fails
at start-up instead of silently halving the groups a step trains.

    python chat_template.py FILE     # write the checked template to FILE (serve_policy.sh: vLLM's --chat-template)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

# The file behind trl.chat_template_utils.lfm2_2_5_chat_template (TRL's chat_templates/README.md: "Original LFM2.5
# chat template (as shipped by LiquidAI/LFM2.5-230M and the other checkpoints in that generation)").
TRL_TEMPLATE_FILE = "lfm2_2_5.jinja"
GENERATION_PROMPT = "<|im_start|>assistant\n"
BOS = "<|startoftext|>"
END = "<|im_end|>"
# Assistant turns as OpenCode sends them back (vLLM's lfm2 parser split the sampled text into content and
# tool_calls; vLLM's chat_utils turned the arguments into a dict), each with the text LFM2.5 sampled for it in the
# template's own format. A template is prefix-stable when it renders each turn back as exactly that text.
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


def render(template: str, messages: list[dict], *, add_generation_prompt: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _generation_indices = render_jinja_template(
        conversations=[messages], chat_template=template, bos_token=BOS, add_generation_prompt=add_generation_prompt)
    return rendered[0]


def check(template: str) -> None:
    """Raise ChatTemplateError unless `template` renders each agent turn back as the text that was sampled for it."""
    history = [{"role": "system", "content": "Coding agent."}, {"role": "user", "content": "How many rows?"}]
    prompt = render(template, history, add_generation_prompt=True)
    if not prompt.endswith(GENERATION_PROMPT):
        raise ChatTemplateError(
            f"the chat template's generation prompt ends {prompt[-40:]!r}, not {GENERATION_PROMPT!r}: whatever it "
            "opens there (e.g. <think>) is in the sampled prompt but in no assistant turn rendered back, so every "
            "turn after the first would fork a new training row; use TRL 1.15's lfm2_2_5_chat_template")
    for message, sampled in TURNS:
        after = [*history, message, {"role": "tool", "content": "3 data.csv"}]
        rendered = render(template, after, add_generation_prompt=True)
        if not rendered.startswith(prompt + sampled + END):
            back = rendered[len(prompt) - 20 :][:160]
            raise ChatTemplateError(
                f"the chat template renders the assistant turn {sampled!r} back as {back!r}: the next prompt would "
                "not extend the sampled tokens and TRL would fork the rollout into a new row")


def template_text() -> str:
    """The file TRL's `lfm2_2_5_chat_template` is read from, found without importing trl (a minute of CPU on a
    loaded machine, on serve_policy.sh's path to vLLM's start)."""
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
