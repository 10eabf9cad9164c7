"""A ChatML template with tools, shaped like Qwen2.5's (hermes tool calls), for the tiny tokenizers built here.

The tools are listed by name in a system block (short: a tiny model's prompt budget is small; real models bring
their own template); tool messages are wrapped in <tool_response> inside one user turn per run of consecutive
tool messages, as Qwen2.5 does, so tool_agent's incremental tokens meet the same layout a real model sees.
"""
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n' }}{%- endif %}"
    "{{ 'Tools:' }}{%- for tool in tools %}{{ ' ' + tool['function']['name'] }}{%- endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{%- endif %}"
    "{%- elif not (message['role'] == 'system' and loop.first) %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
