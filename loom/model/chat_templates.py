"""Chat templates for model files that ship without one (Gemma 3's GGUF files carry none): the turn format the model
was trained on, as a jinja template like any file's."""

from __future__ import annotations

# Gemma 3: user and model turns; a system message goes at the head of the first user turn; content is a string or a
# list of text parts.
GEMMA3 = """{{- bos_token -}}
{%- set system = namespace(text='') -%}
{%- for message in messages -%}
  {%- if message['content'] is string -%}
    {%- set content = message['content'] -%}
  {%- else -%}
    {%- set content = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
  {%- endif -%}
  {%- if message['role'] == 'system' -%}
    {%- set system.text = content + '\\n\\n' -%}
  {%- else -%}
    {%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}
    {{- '<start_of_turn>' + role + '\\n' + (system.text if role == 'user' else '') + content | trim + '<end_of_turn>\\n' -}}
    {%- if role == 'user' -%}{%- set system.text = '' -%}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"""

FOR_ARCHITECTURE = {"gemma3": GEMMA3}
