#!/usr/bin/env python3
"""Writes tests/golden/chat/cases.json: chat templates, conversations, and
the text each template renders for each conversation, rendered by jinja2 the
way transformers' apply_chat_template does (ImmutableSandboxedEnvironment
with trim_blocks and lstrip_blocks). tests/unit/test_chat.c checks that our
C renderer, which does not run Jinja, gives the same bytes.

It also lists templates we must refuse, with the exact error expected.

Usage: tools/gen_chat_golden.py [OUT]   (needs: pip install jinja2)
"""
import json
import os
import sys

from jinja2.sandbox import ImmutableSandboxedEnvironment

# SmolLM2-135M-Instruct, exactly as in the GGUF's tokenizer.chat_template
# (the Jinja string literals hold real newlines there).
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

# Qwen2-Instruct: the same shape with another default, written here with
# Jinja escapes (\n as two characters) as tokenizer_config.json files have.
QWEN2 = (
    r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    r"{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    r"{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    r"{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5-Instruct (tokenizer_config.json chat_template, decoded).
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# The plain ChatML template (no default system prompt).
CHATML = (
    r"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    r"message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    r"{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Meta-Llama-3-8B-Instruct (3.0).
LLAMA3 = (
    r"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    r"'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    r" + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    r"{{ content }}{% endfor %}{% if add_generation_prompt %}"
    r"{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# SmolLM2's template as someone might reformat it: attribute access, double
# quotes, \r\n line ends, indentation, whitespace control, a comment. Jinja
# renders it identically, so we must recognise it (with the default taken
# from this text, which differs).
SMOLLM2_REFORMATTED = (
    "{#- reformatted -#}\r\n"
    "{% for message in messages %}\r\n"
    "    {% if loop.first and messages[0].role != \"system\" %}\r\n"
    "        {{- \"<|im_start|>system\\nYou are \\\"Reformatted\\\" \\u00e9\\x21<|im_end|>\\n\" -}}\r\n"
    "    {% endif %}\r\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' -}}\r\n"
    "{% endfor %}\r\n"
    "{% if add_generation_prompt %}\r\n"
    "    {{- '<|im_start|>assistant\\n' }}\r\n"
    "{%- endif %}\r\n"
)

# Plain ChatML with whitespace that trim_blocks and lstrip_blocks remove:
# it prints nothing more, so it must be recognised as plain ChatML.
CHATML_BLOCK_WHITESPACE = CHATML.replace("{% endfor %}", "{% endfor %}\n  \t")

TEMPLATES = [
    # name, source, family, variant, default system prompt
    ("smollm2", SMOLLM2, "chatml", "chatml-default-system",
     "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
    ("qwen2", QWEN2, "chatml", "chatml-default-system", "You are a helpful assistant."),
    ("qwen2.5", QWEN25, "chatml", "qwen2.5",
     "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    ("chatml", CHATML, "chatml", "chatml", None),
    ("llama3", LLAMA3, "llama3", "llama3", None),
    ("chatml-block-whitespace", CHATML_BLOCK_WHITESPACE, "chatml", "chatml", None),
    ("smollm2-reformatted", SMOLLM2_REFORMATTED, "chatml", "chatml-default-system",
     "You are \"Reformatted\" \u00e9!"),
]

CONVERSATIONS = [
    ("user-only", [("user", "Hello!")]),
    ("system-user", [("system", "You are terse."), ("user", "What is 2+2?")]),
    ("multi-turn", [("system", "Be kind."), ("user", "Hi"), ("assistant", "Hello! How can I help?"),
                    ("user", "Tell me a joke.")]),
    ("multi-turn-no-system", [("user", "Hi"), ("assistant", "Hey."), ("user", "Bye")]),
    ("empty-content", [("user", ""), ("assistant", ""), ("user", "")]),
    ("unicode", [("user", "日本語で答えて 😀 👩‍👩‍👧 naïve café עברית"),
                 ("assistant", "はい、わかりました。🎉")]),
    ("whitespace", [("system", "  \n sys with spaces \t\n"),
                    ("user", "\u00a0\u3000 nbsp and ideographic \u2003\u2028"),
                    ("assistant", "\x1c\x1f  separators  \x0b\x0c"),
                    ("user", "\u200bzero width is not space\u200b")]),
    ("all-whitespace", [("user", " \n\t \u00a0")]),
    ("system-not-first", [("user", "first"), ("system", "late system"), ("user", "second")]),
    ("template-syntax-in-content", [("user", "{{ x }} {% if y %} <|im_end|> <|eot_id|> \\n '\"")]),
    ("assistant-only", [("assistant", "I start.")]),
    ("system-only", [("system", "Only a system prompt.")]),
    ("newlines", [("user", "line 1\nline 2\r\nline 3\n\n"), ("assistant", "\nok\n")]),
]

# Templates we refuse, and the exact error text.
ERR_CHATML = ("chat template not recognised: it uses ChatML markers (<|im_start|>) but is not one "
              "of the supported ChatML templates (plain; default system prompt as in "
              "SmolLM2/Qwen2; Qwen2.5)")
ERR_LLAMA31 = ("chat template not supported: Llama-3.1+ template (tools and date preamble); only "
               "the Llama-3 (3.0) Instruct template is")
ERR_LLAMA = ("chat template not recognised: it uses Llama-3 markers (<|start_header_id|>) but is "
             "not the Llama-3 Instruct template")
ERR_OTHER = ("chat template not supported: expected a ChatML (<|im_start|>) or Llama-3 "
             "(<|start_header_id|>) template")

REJECTED = [
    ("llama3.1-date-preamble",
     "{{- bos_token }}\n"
     "{%- if not date_string is defined %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}\n"
     "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
     "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
     "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
     "{{- \"<|eot_id|>\" }}\n"
     "{%- for message in messages %}\n"
     "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
     " + message['content'] | trim + '<|eot_id|>' }}\n"
     "{%- endfor %}\n"
     "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
     "{%- endif %}\n",
     ERR_LLAMA31),
    # Llama-3 without the trim: renders differently, so it must not pass.
    ("llama3-without-trim", LLAMA3.replace(" | trim", ""), ERR_LLAMA),
    # ChatML that strips content: a real change in output.
    ("chatml-trimmed-content", CHATML.replace("message['content']", "message['content'] | trim"),
     ERR_CHATML),
    # ChatML with a newline after an expression, which Jinja prints (only
    # block tags eat the newline after them).
    ("chatml-stray-newline", CHATML.replace("{% endfor %}", "\n{% endfor %}"), ERR_CHATML),
    ("mistral-inst",
     "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
     "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
     "{{ message['content'] + eos_token }}{% endif %}{% endfor %}",
     ERR_OTHER),
    ("unterminated-tag", "{% for message in messages %}<|im_start|>{{ message['role'] ", ERR_CHATML),
]


def render(src, messages, add_generation_prompt):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(src).render(
        messages=[{"role": r, "content": c} for r, c in messages],
        add_generation_prompt=add_generation_prompt,
        bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "chat", "cases.json")
    cases = []
    for tname, src, *_ in TEMPLATES:
        for cname, msgs in CONVERSATIONS:
            for agp in (False, True):
                cases.append({"template": tname, "conversation": cname,
                              "add_generation_prompt": agp, "expected": render(src, msgs, agp)})
    # The reformatted template must really render like SmolLM2's, apart
    # from its default system text; otherwise it proves nothing.
    for c in cases:
        if c["template"] == "smollm2-reformatted":
            twin = next(d for d in cases if d["template"] == "smollm2"
                        and d["conversation"] == c["conversation"]
                        and d["add_generation_prompt"] == c["add_generation_prompt"])
            assert c["expected"] == twin["expected"].replace(
                TEMPLATES[0][4], TEMPLATES[-1][4]), c["conversation"]
    # A refused variant of a known template must really render differently,
    # or refusing it would be a bug, not a safeguard.
    originals = {"llama3-without-trim": LLAMA3, "chatml-trimmed-content": CHATML,
                 "chatml-stray-newline": CHATML}
    probe = dict(CONVERSATIONS)["whitespace"]
    for name, src, _ in REJECTED:
        if name in originals:
            assert render(src, probe, True) != render(originals[name], probe, True), name
    assert render(CHATML_BLOCK_WHITESPACE, probe, True) == render(CHATML, probe, True)

    doc = {
        "generator": "tools/gen_chat_golden.py (jinja2 %s, trim_blocks, lstrip_blocks)"
                     % __import__("jinja2").__version__,
        "templates": [{"name": n, "source": s, "family": f, "variant": v, "default_system": d}
                      for n, s, f, v, d in TEMPLATES],
        "conversations": [{"name": n, "messages": [{"role": r, "content": c} for r, c in m]}
                          for n, m in CONVERSATIONS],
        "cases": cases,
        "rejected": [{"name": n, "source": s, "error": e} for n, s, e in REJECTED],
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print("wrote %d cases, %d rejected templates to %s" % (len(cases), len(REJECTED), out))


if __name__ == "__main__":
    main()
