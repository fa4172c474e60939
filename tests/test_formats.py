"""Each target family's answer format through the server: a tiny target scripted to answer in the
family's own format (its reasoning, then a tool call) behind the family's chat format, asked through
the OpenAI, Anthropic and Responses routes, whole and streamed; the call then goes back in the
history and renders as the family's template writes it.

The templates below are the published ones in small: the parts these requests reach (generation
prompt, thinking switch, earlier calls and their results; tool declarations simplified) render the
same strings as (gpt-oss's checked by rendering both on these conversations; the others written
from the published text, not rendered against it here)
- Qwen3: Qwen/Qwen3-8B's tokenizer_config.json (``<think>``, ``<tool_call>`` JSON);
- Qwen3-Coder: Qwen/Qwen3-Coder-30B-A3B-Instruct's (no thinking; ``<function=NAME>`` / ``<parameter=P>`` calls);
- Llama 3.1: meta-llama/Llama-3.1-8B-Instruct's (custom tools in the first user turn, a call as the
  whole answer ``{"name": .., "parameters": ..}``, results as ``ipython`` turns);
- gpt-oss: openai/gpt-oss-20b's chat_template.jinja (harmony; as last changed in its "Update
  chat_template.jinja (#94)", mirrored at github.com/EchoCog/gpt-oss-20b @ 5dfb765) but for the tool
  declarations (written as JSON schemas here, as TypeScript there) and a fixed date;
- Gemma 4: google/gemma-4's (github.com/ggml-org/llama.cpp models/templates/gemma4.jinja @ 75f1ba73: ``<|think|>`` in
  the system turn, ``<|channel>thought`` … ``<channel|>``, ``<|tool_call>call:NAME{k:<|"|>v<|"|>}<tool_call|>``).
The oracle for what the server returns is the text the target was scripted to write and the
templates' own rendering of the conversation (``apply_chat_template``), not the parsers under test.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest

from dflash_mlx import tiny
from dflash_mlx.scripted import point_head

REASONING = "The quick brown fox"
ARGS = {"city": "Paris"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
USER = [{"role": "user", "content": "weather in Paris?"}]

QWEN3 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\\n<tools>\" }}{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n"
    "</tool_call><|im_end|>\\n\" }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set content = message.content or '' %}"
    "{%- if message.reasoning_content and loop.last == false and loop.index0 > 0 %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
LLAMA31 = (
    "{{- bos_token }}{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}{{- 'Today Date: 26 Jul 2024\\n\\n' }}{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools is not none %}{%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}"
    "{{- 'Given the following functions, please respond with a JSON for a function call ' }}"
    "{{- 'with its proper arguments that best answers the given prompt.\\n\\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}"
    "{{- 'Do not use variables.\\n\\n' }}{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>'}}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}{%- set tool_call = message.tool_calls[0].function %}"
    "{%- if builtin_tools is defined and tool_call.name in builtin_tools %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{{- '<|python_tag|>' + tool_call.name + '.call(' }}"
    "{%- for arg_name, arg_val in tool_call.arguments | items %}{{- arg_name + '=\"' + arg_val + '\"' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ')' }}"
    "{%- else %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}{{- '}' }}{%- endif %}"
    "{%- if builtin_tools is defined %}{{- '<|eom_id|>' }}{%- else %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}{{- '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN3_CODER = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' }}{%- for tool in tools %}{{- '\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\n</tools>' }}"
    "{{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>' }}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls or [] %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}{%- for args_name, args_value in tool_call.arguments|items %}"
    "{{- '<parameter=' + args_name + '>\n' }}{{- args_value if args_value is string else args_value | tojson }}{{- '\n</parameter>\n' }}"
    "{%- endfor %}{{- '</function>\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
GPT_OSS = (
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\nKnowledge cutoff: 2024-06\\n"
    "Current date: 2025-08-05\\n\\n' }}{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
    "{{- 'Reasoning: ' + reasoning_effort + '\\n\\n' }}{{- '# Valid channels: analysis, commentary, final. Channel must be "
    "included for every message.\\n' }}{{- \"Calls to these tools must go to the commentary channel: 'functions'.\" }}{{- '<|end|>' }}"
    "{%- if messages[0].role == 'developer' or messages[0].role == 'system' %}{%- set developer_message = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set developer_message = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if developer_message or tools %}{{- '<|start|>developer<|message|>' }}"
    "{%- if developer_message %}{{- '# Instructions\\n\\n' }}{{- developer_message }}{{- '\\n\\n' }}{%- endif %}"
    "{%- if tools -%}{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}{%- for tool in tools %}"
    "{%- set tool = tool.function %}{{- '// ' + tool.description + '\\ntype ' + tool.name + ' = (_: ' + tool.parameters | tojson + ') => any;\\n' }}"
    "{%- endfor %}{{- '\\n} // namespace functions' }}{%- endif -%}{{- '<|end|>' }}{%- endif %}"
    "{%- set last_tool_call = namespace(name=none) %}"
    "{%- for message in loop_messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- if 'tool_calls' in message %}{%- set future_final_message = namespace(found=false) %}"
    "{%- for future_message in loop_messages[loop.index:] %}"
    "{%- if future_message.role == 'assistant' and 'tool_calls' not in future_message %}{%- set future_final_message.found = true %}"
    "{%- endif %}{%- endfor %}{%- set tool_call = message.tool_calls[0] %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message.content and message.thinking %}{{- raise_exception('Cannot pass both content and thinking') }}"
    "{%- elif message.content and not future_final_message.found %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.thinking and not future_final_message.found %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant to=' }}{{- 'functions.' + tool_call.name + '<|channel|>commentary json<|message|>' }}"
    "{{- tool_call.arguments|tojson }}{{- '<|call|>' }}{%- set last_tool_call.name = tool_call.name %}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- set last_tool_call.name = none %}{%- endif %}"
    "{%- elif message.role == 'tool' -%}{{- '<|start|>functions.' + last_tool_call.name }}"
    "{{- ' to=assistant<|channel|>commentary<|message|>' + message.content|tojson + '<|end|>' }}"
    "{%- elif message.role == 'user' -%}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
GEMMA4 = (
    "{%- macro format_argument(argument) -%}{%- if argument is string -%}{{- '<|\"|>' + argument + '<|\"|>' -}}"
    "{%- elif argument is boolean -%}{{- 'true' if argument else 'false' -}}{%- else -%}{{- argument -}}{%- endif -%}{%- endmacro -%}"
    "{%- set ns = namespace(prev_message_type=None) -%}{%- set loop_messages = messages -%}{{ bos_token }}"
    "{%- if (enable_thinking is defined and enable_thinking) or tools or messages[0]['role'] in ['system', 'developer'] -%}"
    "{{- '<|turn>system\\n' -}}{%- if enable_thinking is defined and enable_thinking -%}{{- '<|think|>' -}}{%- endif -%}"
    "{%- if messages[0]['role'] in ['system', 'developer'] -%}{{- messages[0]['content'] | trim -}}"
    "{%- set loop_messages = messages[1:] -%}{%- endif -%}"
    "{%- if tools -%}{%- for tool in tools %}{{- '<|tool>declaration:' + tool['function']['name'] + '{description:<|\"|>' -}}"
    "{{- tool['function']['description'] + '<|\"|>}<tool|>' -}}{%- endfor %}{%- endif -%}{{- '<turn|>\\n' -}}{%- endif %}"
    "{%- for message in loop_messages -%}{%- set ns.prev_message_type = None -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}{{- '<|turn>' + role + '\\n' }}"
    "{%- if message['tool_calls'] -%}{%- for tool_call in message['tool_calls'] -%}{%- set function = tool_call['function'] -%}"
    "{{- '<|tool_call>call:' + function['name'] + '{' -}}{%- if function['arguments'] is mapping -%}"
    "{%- set ns_args = namespace(found_first=false) -%}{%- for key, value in function['arguments'] | dictsort -%}"
    "{%- if ns_args.found_first %},{% endif -%}{%- set ns_args.found_first = true -%}"
    "{{- key -}}:{{- format_argument(value) -}}{%- endfor -%}{%- endif -%}{{- '}<tool_call|>' -}}{%- endfor -%}"
    "{%- set ns.prev_message_type = 'tool_call' -%}{%- endif -%}"
    "{%- if message['tool_responses'] -%}{%- for tool_response in message['tool_responses'] -%}{{- '<|tool_response>' -}}"
    "{%- if tool_response['response'] is mapping -%}{{- 'response:' + tool_response['name'] | default('unknown') + '{' -}}"
    "{%- for key, value in tool_response['response'] | dictsort -%}{{- key -}}:{{- format_argument(value) -}}"
    "{%- if not loop.last %},{% endif -%}{%- endfor -%}{{- '}' -}}"
    "{%- else -%}{{- 'response:' + tool_response['name'] | default('unknown') + '{value:' + format_argument(tool_response['response']) + '}' -}}"
    "{%- endif -%}{{- '<tool_response|>' -}}{%- endfor -%}{%- set ns.prev_message_type = 'tool_response' -%}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] | trim -}}{%- endif -%}"
    "{%- if not (message['tool_responses'] and not message['content']) -%}{{- '<turn|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{%- if ns.prev_message_type != 'tool_response' -%}{{- '<|turn>model\\n' -}}{%- endif -%}"
    "{%- if not enable_thinking | default(false) -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}{%- endif -%}"
)


@dataclass
class Family:
    name: str
    template: str
    pieces: List[str]  # the scripted answer; pieces in ``tokens`` are one token each (none may repeat)
    tokens: List[str]
    reasoning: str  # what the answer's reasoning reads as ("" for a family without)
    thinking: Optional[bool] = None  # enable_thinking for the template (None: its default)
    call_back: str = ""  # the call as the template writes it back in the history

    @property
    def text(self) -> str:
        return "".join(self.pieces)


QWEN_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CODER_OPEN, CODER_CLOSE = "<tool_call>\n<function=get_weather>\n<parameter=city>\n", "\n</parameter>\n</function>\n</tool_call>"
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
HARMONY_CALL = "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
FAMILIES = [
    Family("qwen3", QWEN3, ["<think>\n", REASONING, "\n</think>\n\n<tool_call>\n", QWEN_CALL, "\n</tool_call>"],
           ["<think>\n", "\n</think>\n\n<tool_call>\n", QWEN_CALL, "\n</tool_call>"], REASONING + "\n",
           call_back=f"<tool_call>\n{QWEN_CALL}\n</tool_call>"),
    Family("qwen3-coder", QWEN3_CODER, [CODER_OPEN, "Paris", CODER_CLOSE], [CODER_OPEN, CODER_CLOSE], "",
           call_back=f"\n{CODER_OPEN}Paris{CODER_CLOSE}"),
    Family("llama3.1", LLAMA31, [LLAMA_CALL], [LLAMA_CALL, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                               "<|python_tag|>"], "", call_back=LLAMA_CALL + "<|eot_id|>"),
    Family("gpt-oss", GPT_OSS, ["<|channel|>analysis<|message|>", REASONING, HARMONY_CALL, '{"city": "Paris"}'],
           ["<|channel|>analysis<|message|>", HARMONY_CALL, '{"city": "Paris"}', "<|start|>", "<|end|>", "<|message|>",
            "<|channel|>"], REASONING,
           call_back='<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'),
    Family("gemma4", GEMMA4, ["<|channel>thought\n", REASONING, "<channel|>", "<|tool_call>", 'call:get_weather{city:<|"|>Paris<|"|>}',
                              "<tool_call|>"],
           ["<|channel>thought\n", "<channel|>", "<|tool_call>", 'call:get_weather{city:<|"|>Paris<|"|>}', "<tool_call|>",
            "<|turn>", "<turn|>", "<|think|>"], REASONING, thinking=True,
           call_back='<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'),
]


def family_checkpoints(root, family: Family):
    """A tiny pair in ``family``'s chat format, its target's head not pointed yet: (target folder,
    draft folder, tokenizer, the generation prompt's ids, end token, ``ids(pieces)``: the pieces as
    token ids, each special token of the family's as itself)."""
    from transformers import AutoTokenizer

    target_dir, draft_dir = root / "target", root / "draft"
    eos = tiny.write_tokenizer(target_dir, extra_special_tokens=family.tokens)
    config = tiny.write_target(target_dir, tiny.target_config(512, eos_token_id=eos))
    tiny.write_draft(draft_dir, tiny.draft_config(config, block_size=16))
    (target_dir / "chat_template.jinja").write_text(family.template)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    prompt = tokenizer.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, **kwargs(family))
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "input_ids") else prompt

    def ids(pieces):
        return [t for p in pieces for t in ([tokenizer.convert_tokens_to_ids(p)] if p in family.tokens else
                                            tokenizer.encode(p, add_special_tokens=False))]

    return target_dir, draft_dir, tokenizer, prompt, eos, ids


def write_family_pair(root, family: Family):
    """A tiny pair whose target writes ``family.text`` after the family's generation prompt."""
    target_dir, draft_dir, tokenizer, prompt, eos, ids = family_checkpoints(root, family)
    answer = ids(family.pieces)
    chain = [prompt[-1]] + answer + [eos]
    assert len(set(chain)) == len(chain), f"{family.name}: the scripted answer repeats a token: {chain}"
    assert tokenizer.decode(answer) == family.text
    point_head(target_dir, [chain])
    return target_dir, draft_dir


def kwargs(family: Family) -> Dict:
    return {} if family.thinking is None else {"enable_thinking": family.thinking}


@contextmanager
def serving(family: Family, root):
    """The family's scripted pair behind an in-process server: (family, client, tokenizer, model)."""
    from fastapi.testclient import TestClient

    from dflash_mlx.api import load
    from dflash_mlx.server import create_app

    target, draft = write_family_pair(root, family)
    model, tokenizer = load(str(target), draft=str(draft))
    with TestClient(create_app(model, tokenizer, "tiny", chat_template_args=kwargs(family))) as client:
        yield family, client, tokenizer, model


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.name for f in FAMILIES])
def served(request, tmp_path_factory):
    with serving(request.param, tmp_path_factory.mktemp(request.param.name)) as served:
        yield served


def events(body: str):
    """Server-sent events: (name or None, data) pairs, without the [DONE] sentinel."""
    out, name = [], None
    for line in body.splitlines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: ") and line != "data: [DONE]":
            out.append((name, json.loads(line[len("data: "):])))
            name = None
    return out


def test_the_target_writes_the_scripted_answer(served):
    """What the routes split: the target's greedy answer through the library, the family's text."""
    from dflash_mlx import generate

    family, _, tokenizer, model = served
    ids = tokenizer.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, **kwargs(family))
    assert generate(model, tokenizer, list(ids), max_tokens=40) == family.text


@pytest.mark.parametrize("stream", [False, True])
def test_openai_route(served, stream):
    family, client, _, _ = served
    body = {"model": "tiny", "messages": USER, "tools": TOOLS, "max_tokens": 40, "temperature": 0, "stream": stream}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    if stream:
        deltas = [d["choices"][0]["delta"] for _, d in events(reply.text) if d.get("choices")]
        finish = [d["choices"][0]["finish_reason"] for _, d in events(reply.text) if d.get("choices")][-1]
        thought = "".join(d.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        parts = [c for d in deltas for c in d.get("tool_calls") or []]
        calls = [{"name": p["function"]["name"], "arguments": ""} for p in parts if "id" in p]
        for p in parts:
            if "id" not in p:
                calls[p["index"]]["arguments"] += p["function"]["arguments"]
    else:
        choice = reply.json()["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        thought, content = message.get("reasoning_content") or "", message.get("content") or ""
        calls = [c["function"] for c in message.get("tool_calls") or []]
    assert thought == family.reasoning and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", ARGS)] and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_route(served, stream):
    family, client, _, _ = served
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    body = {"model": "tiny", "messages": USER, "tools": tools, "max_tokens": 40, "temperature": 0, "stream": stream}
    reply = client.post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.text
    if stream:
        blocks: Dict[int, Dict] = {}
        for name, data in events(reply.text):
            if name == "content_block_start":
                blocks[data["index"]] = dict(data["content_block"], partial="")
            elif name == "content_block_delta":
                block, delta = blocks[data["index"]], data["delta"]
                key = {"thinking_delta": "thinking", "text_delta": "text", "input_json_delta": "partial"}[delta["type"]]
                block[key] = block.get(key, "") + delta[{"input_json_delta": "partial_json"}.get(delta["type"], key)]
            elif name == "message_delta":
                stop = data["delta"]["stop_reason"]
        content = [dict(b, input=json.loads(b["partial"])) if b["type"] == "tool_use" else b for _, b in sorted(blocks.items())]
    else:
        message = reply.json()
        content, stop = message["content"], message["stop_reason"]
    kinds = [b["type"] for b in content]
    assert kinds == (["thinking"] if family.reasoning else []) + ["tool_use"] and stop == "tool_use"
    assert "".join(b.get("thinking", "") for b in content) == family.reasoning
    assert [(b["name"], b["input"]) for b in content if b["type"] == "tool_use"] == [("get_weather", ARGS)]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_route(served, stream):
    family, client, _, _ = served
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    body = {"model": "tiny", "input": USER[0]["content"], "tools": tools, "max_output_tokens": 40, "temperature": 0,
            "stream": stream}
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    if stream:
        done = [d for _, d in events(reply.text) if d.get("type") == "response.completed"]
        output = done[-1]["response"]["output"]
    else:
        output = reply.json()["output"]
    assert [item["type"] for item in output] == (["reasoning"] if family.reasoning else []) + ["function_call"]
    assert "".join(c["text"] for item in output if item["type"] == "reasoning" for c in item["content"]) == family.reasoning
    call = output[-1]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == ARGS


def test_the_call_goes_back_as_the_template_writes_it(served):
    """The next turn: the call the server returned, and its result, render through the family's
    template as the model wrote the call (the prompt the server counts is the template's own)."""
    family, client, tokenizer, _ = served
    first = client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "tools": TOOLS, "max_tokens": 40,
                                                      "temperature": 0}).json()["choices"][0]["message"]
    call = first["tool_calls"][0]
    answer = {"role": "assistant", "content": None, "tool_calls": [call]}
    if family.reasoning:  # the reasoning goes back too, under the name the family's template reads
        answer["reasoning_content"] = first["reasoning_content"]
    history = USER + [answer, {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    reply = client.post("/v1/chat/completions", json={"model": "tiny", "messages": history, "tools": TOOLS,
                                                      "max_tokens": 40, "temperature": 0})
    assert reply.status_code == 200, reply.text
    rendered_call = dict(call, function=dict(call["function"], arguments=json.loads(call["function"]["arguments"])))
    result = GEMMA4_SUNNY if family.name == "gemma4" else history[2]  # Gemma 4's reads tool_responses only
    expected = USER + [{"role": "assistant", "tool_calls": [rendered_call]}, result]
    if family.reasoning:
        expected[1]["thinking" if family.name == "gpt-oss" else "reasoning_content"] = family.reasoning
    text = tokenizer.apply_chat_template(expected, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs(family))
    assert family.call_back in text
    if family.name == "gemma4":
        assert text.endswith(GEMMA4_RESULT.format(name="get_weather", value="sunny"))
    if family.name == "gpt-oss":  # gpt-oss's template writes a call's reasoning back (the others drop it here)
        assert f"<|channel|>analysis<|message|>{REASONING}<|end|>" in text
    ids = tokenizer.apply_chat_template(expected, tools=TOOLS, add_generation_prompt=True, **kwargs(family))
    assert reply.json()["usage"]["prompt_tokens"] == len(ids)


# A tool's result as Gemma 4's template documents it: ``tool_responses`` on a tool turn, which the
# answer continues (no ``<turn|>``, no new model turn).
GEMMA4_SUNNY = {"role": "tool", "tool_responses": [{"name": "get_weather", "response": "sunny"}]}
GEMMA4_RESULT = '<|tool_response>response:{name}{{value:<|"|>{value}<|"|>}}<tool_response|>'


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    with serving(next(f for f in FAMILIES if f.name == "gemma4"), tmp_path_factory.mktemp("gemma4_results")) as served:
        yield served


@pytest.mark.parametrize("route", ["chat", "messages", "responses"])
def test_gemma4_tool_results_render_as_its_template_writes_them(gemma4, route):
    """Two calls and their results (the second given first, as a client may) sent back through each
    route: the prompt is the template's rendering of them as ``tool_responses`` in one tool turn,
    each named after its call (the oracle: the documented form, written here, through the template)."""
    from dflash_mlx.reasoning import template_messages

    family, client, tokenizer, _ = gemma4
    cities = {"call_1": "Paris", "call_2": "Lyon"}
    weather = {"call_1": "sunny", "call_2": "rain"}
    if route == "chat":
        calls = [{"id": i, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
                 for i, c in cities.items()]
        history = USER + [{"role": "assistant", "content": None, "tool_calls": calls}] + [
            {"role": "tool", "tool_call_id": i, "content": weather[i]} for i in ("call_2", "call_1")]
        reply = client.post("/v1/chat/completions", json={"model": "tiny", "messages": history, "tools": TOOLS,
                                                          "max_tokens": 1}).json()
        counted = reply["usage"]["prompt_tokens"]
    elif route == "messages":
        tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": TOOLS[0]["function"]["parameters"]}]
        history = USER + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "get_weather", "input": {"city": c}}
                                              for i, c in cities.items()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": weather[i]}
                                         for i in ("call_2", "call_1")]}]
        reply = client.post("/v1/messages", json={"model": "tiny", "messages": history, "tools": tools, "max_tokens": 1}).json()
        counted = reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"]
    else:
        items = [{"type": "message", "role": "user", "content": USER[0]["content"]}] + [
            {"type": "function_call", "call_id": i, "name": "get_weather", "arguments": json.dumps({"city": c})}
            for i, c in cities.items()] + [
            {"type": "function_call_output", "call_id": i, "output": weather[i]} for i in ("call_2", "call_1")]
        tools = [{"type": "function", **t["function"]} for t in TOOLS]
        reply = client.post("/v1/responses", json={"model": "tiny", "input": items, "tools": tools, "max_output_tokens": 1}).json()
        counted = reply["usage"]["input_tokens"]
    expected = USER + [
        {"role": "assistant", "tool_calls": [{"id": i, "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
                                             for i, c in cities.items()]},
        {"role": "tool", "tool_responses": [{"name": "get_weather", "response": weather[i]} for i in ("call_2", "call_1")]}]
    text = tokenizer.apply_chat_template(expected, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs(family))
    assert text.endswith("<|turn>tool\n" + GEMMA4_RESULT.format(name="get_weather", value="rain")
                         + GEMMA4_RESULT.format(name="get_weather", value="sunny"))
    assert counted == len(tokenizer.apply_chat_template(expected, tools=TOOLS, add_generation_prompt=True, **kwargs(family))), reply
    if route == "chat":  # the same conversation, as the adapter hands it to the template: the same text
        from dflash_mlx.server.openai import Message, _message_dict

        adapted = template_messages(tokenizer, [_message_dict(Message(**m), i, []) for i, m in enumerate(history)])
        assert tokenizer.apply_chat_template(adapted, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                             **kwargs(family)) == text


def test_gemma4_takes_a_result_without_its_call_as_the_template_names_it():
    """A result whose call is not in the history (or a tool turn already in the template's form)
    keeps the template's own defaults: ``unknown`` as the name, the given turn as it is."""
    from types import SimpleNamespace

    from dflash_mlx.reasoning import template_messages

    tokenizer = SimpleNamespace(chat_template=GEMMA4)
    assert template_messages(tokenizer, USER + [{"role": "tool", "tool_call_id": "x", "content": "42"}, GEMMA4_SUNNY]) == \
        USER + [{"role": "tool", "tool_responses": [{"name": "unknown", "response": "42"}]}, GEMMA4_SUNNY]


def test_streamed_a_character_at_a_time_nothing_of_a_marker_leaks(served):
    """The same answer fed one character at a time (a marker split anywhere) splits as the whole."""
    from dflash_mlx.reasoning import splitters
    from dflash_mlx.server.tool_calls import ToolCall, ToolCallScanner

    family, _, tokenizer, _ = served
    prompt = tokenizer.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, **kwargs(family))
    splitter, scanner = splitters(tokenizer, prompt)(), ToolCallScanner(tokenizer, TOOLS)
    thought, pieces = "", []
    for character in family.text:
        r, c = splitter.push(character)
        thought, pieces = thought + r, pieces + scanner.push(c)
    r, c = splitter.flush()
    thought, pieces = thought + r, pieces + scanner.push(c) + scanner.flush()
    assert thought == family.reasoning and "".join(p for p in pieces if isinstance(p, str)).strip() == ""
    assert [(p.name, p.arguments) for p in pieces if isinstance(p, ToolCall)] == [("get_weather", ARGS)]


@pytest.mark.parametrize("text, expected", [
    ("It is sunny.", ["It is sunny."]),  # an answer that is not a call passes through at once
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {}}', [("f", {"a": 1}), ("g", {})]),
    ('{"name": "f", "parameters": {"a": 1}} and more', ['{"name": "f", "parameters": {"a": 1}} and more']),
    ('{"not": "a call"}', ['{"not": "a call"}']),
])
def test_llama_calls_are_the_whole_answer(tmp_path_factory, text, expected):
    from transformers import AutoTokenizer

    from dflash_mlx.server.tool_calls import ToolCall, ToolCallScanner

    folder = tmp_path_factory.mktemp("llama_tokenizer")
    tiny.write_tokenizer(folder)
    (folder / "chat_template.jinja").write_text(LLAMA31)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    scanner = ToolCallScanner(tokenizer, TOOLS)
    streamed = [p for character in text for p in scanner.push(character)] + scanner.flush()
    got = [(p.name, p.arguments) if isinstance(p, ToolCall) else p for p in streamed]
    assert ("".join(got) if all(isinstance(g, str) for g in got) else got) == \
        ("".join(expected) if all(isinstance(e, str) for e in expected) else expected)


# Each family's pair by name, and doctor's memory estimate for the attention-only families.

def test_named_pairs_resolve_to_the_target_and_z_labs_draft():
    from dflash_mlx.defaults import PAIRS, resolve, template_args

    assert resolve("qwen3-8b", None) == ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16")
    assert resolve("llama-3.1-8b", None) == ("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat")
    assert resolve("gpt-oss-20b", "my/draft") == ("openai/gpt-oss-20b", "my/draft")  # --draft wins
    assert all(p.draft.startswith("z-lab/") for p in PAIRS.values())
    # z-lab's Qwen3 drafts were trained with thinking off: the server's default, under what the user gives
    assert template_args("qwen3-8b", {}) == {"enable_thinking": False}
    assert template_args("qwen3-8b", {"enable_thinking": True}) == {"enable_thinking": True}
    assert template_args("llama-3.1-8b", {"x": 1}) == {"x": 1} and template_args(None, {}) == {}


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_doctor_counts_every_layer_of_an_attention_only_target_as_attention(family, tmp_path):
    """The KV caches as the config says (every layer, its KV heads and head size, float32 here, in
    the 256-row steps mlx-lm's KVCache grows by) and no Gated DeltaNet state."""
    from dflash_mlx import doctor
    from tests.conftest import make_hf_family_target

    target = make_hf_family_target(tmp_path / family, family)
    config = json.loads((target / "config.json").read_text())
    heads = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    context = 1000
    rows = -(-context // 256) * 256
    estimate = doctor.estimate_memory(target, None, None, context=context)
    assert estimate["attention KV caches"] == config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * heads * 4 * rows
    assert estimate["Gated DeltaNet states"] == 0


def test_gpt_oss_takes_an_answer_with_text_and_a_call_without_its_reasoning(tmp_path):
    """gpt-oss's template refuses reasoning beside the text of an answer that calls a tool (it writes
    one analysis message for both): an Anthropic history with thinking, text and a tool_use is
    rendered with the text alone, as its template takes it, not refused."""
    with serving(next(f for f in FAMILIES if f.name == "gpt-oss"), tmp_path) as (_, client, tokenizer, _):
        reply, ids = _text_call_and_reasoning(client, tokenizer)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["input_tokens"] + reply.json()["usage"]["cache_read_input_tokens"] == len(ids)


def _text_call_and_reasoning(client, tokenizer):
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": TOOLS[0]["function"]["parameters"]}]
    history = USER + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": REASONING, "signature": ""},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": ARGS}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    reply = client.post("/v1/messages", json={"model": "tiny", "messages": history, "tools": tools, "max_tokens": 40})
    expected = USER + [{"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}]
    return reply, tokenizer.apply_chat_template(expected, tools=TOOLS, add_generation_prompt=True)


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_gpt_oss_takes_the_requests_reasoning_effort(tmp_path, route):
    """``reasoning_effort`` (chat) / ``reasoning.effort`` (Responses) reach gpt-oss's template as its
    ``reasoning_effort`` ("Reasoning: high" in its system message) and not as thinking off."""
    with serving(next(f for f in FAMILIES if f.name == "gpt-oss"), tmp_path) as (_, client, tokenizer, _):
        if route == "chat":
            usage = client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 4,
                                                              "reasoning_effort": "high"}).json()["usage"]["prompt_tokens"]
        else:
            usage = client.post("/v1/responses", json={"model": "tiny", "input": USER[0]["content"], "max_output_tokens": 4,
                                                       "reasoning": {"effort": "high"}}).json()["usage"]["input_tokens"]
    high = tokenizer.apply_chat_template(USER, add_generation_prompt=True, reasoning_effort="high")
    medium = tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    assert len(high) != len(medium) and usage == len(high)


def test_every_familys_grammars_are_served(tmp_path):
    """A JSON answer and a forced call are served for every family (200; none is refused for its
    format any more): the grammars write each family's own format (what each writes, and that its
    parser reads it back, is tests/test_structured_families.py's)."""
    body = {"model": "tiny", "messages": USER, "max_tokens": 24}
    forced = dict(body, tools=TOOLS, tool_choice="required")
    json_answer = dict(body, response_format={"type": "json_object"})
    for family in FAMILIES:
        with serving(family, tmp_path / family.name) as (_, client, _, _):
            for request in (json_answer, forced):
                r = client.post("/v1/chat/completions", json=request)
                assert r.status_code == 200, (family.name, r.text)
