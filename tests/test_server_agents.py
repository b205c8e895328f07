"""Coding agents' requests, replayed: bodies in the shapes Claude Code and OpenCode send
(tests/data/agents/) against a server on 127.0.0.1, each answered well-formed in its API and
parsed by the official ``anthropic`` and ``openai`` SDKs. Also: any model name reaches the pair
(aliases, strict refusal), ``max_tokens`` is an upper bound (the reply stops where the context
ends, and the response says how many tokens the context allowed), and a prompt that fills the
context alone is a 400 in each API's shape naming both sizes.

The target is the tiny model with scripted greedy choices (test_server_tools.ScriptedModel)
behind a tokenizer with ``<think>`` markers and a tool-call format; one test runs the tiny
speculative pair itself."""

import json
from dataclasses import replace
from pathlib import Path

from mlx_spec.generation import engine_info
from mlx_spec.loading import load_pair
from mlx_spec.server import anthropic as api
from mlx_spec.server.app import create_app
from mlx_spec.server.schemas import (
    MAX_TOKENS_HEADER,
    NO_DEFAULTS,
    ChatCompletionRequest,
    ModelNames,
)
from mlx_spec.session import Session
from mlx_spec.text import encode_prompt

import anthropic
import httpx
import openai
import pytest
from helpers import save_tiny_pair, save_tiny_tokenizer, tiny_engine_loader
from test_server import running_engine, serve_in_thread
from test_server_tools import ScriptedModel

DATA = Path(__file__).parent / "data" / "agents"
CONTEXT = 1024  # the engine's context: the recorded bodies' max_tokens (32000) is far above it
# Tools shown by name only (keeps the char-level prompts short); assistant tool calls as Qwen writes them
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}"
    "{% for tc in m.get('tool_calls') or [] %}{% set tool_call = tc['function'] %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}"
    "{% endif %}"
)
READ = '<tool_call>{"name": "Read", "arguments": {"file_path": "notes.txt"}}</tool_call>'
READ_OC = '<tool_call>{"name": "read", "arguments": {"arg": "notes.txt"}}</tool_call>'
EXTRA = ("context_management", "output_config")  # fields the SDK's create() has no argument for


def body(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    t, _ = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    save_tiny_tokenizer(t, extra_specials=("<think>", "</think>"), template=TEMPLATE)

    def loader():
        pair = load_pair(str(t), None, no_draft=True)
        pair = replace(pair, model=ScriptedModel(pair.model, pair.tokenizer.eos_token_id))
        return Session.of(pair, engine_info(pair), context=CONTEXT)

    with running_engine(loader) as e:
        yield e


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(create_app(engine, keepalive_s=0.5)) as u:
        yield u


def script(engine, req, text: str) -> int:
    """After the prompt of engine request ``req`` the target says ``text``; returns the prompt's tokens."""

    def fn(pair):
        ids = encode_prompt(
            pair.tokenizer, req.prompt, req.messages, tools=req.tools, template_kwargs=req.template_kwargs
        )
        pair.model.prompt_len = len(ids)
        pair.model.tokens = list(pair.tokenizer.encode(text, add_special_tokens=False))
        return len(ids)

    return engine.call(fn).result(30)


def anthropic_req(b: dict):
    return api.MessagesRequest.model_validate(b).to_engine(CONTEXT, NO_DEFAULTS)


def openai_req(b: dict):
    return ChatCompletionRequest.model_validate(b).to_engine(CONTEXT, NO_DEFAULTS)


# -- Claude Code: Anthropic Messages, ?beta=true, betas, 12 tools, adaptive thinking --------------


@pytest.mark.parametrize("stream", [False, True])
def test_claude_code_request_is_answered_and_parsed_by_the_sdk(engine, url, stream):
    b = body("claude_code_messages.json")
    assert len(b["tools"]) == 12 and b["max_tokens"] == 32000 and b["thinking"] == {"type": "adaptive"}
    assert any(m["role"] == "system" for m in b["messages"])
    n = script(engine, anthropic_req(b), "Plan.</think>I will read it." + READ)
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)
    known = {k: v for k, v in b.items() if k not in EXTRA + ("stream",)}
    extra = {"extra_body": {k: b[k] for k in EXTRA}, "betas": ["claude-code-20250219", "context-management-2025-06-27"]}
    if stream:
        with client.beta.messages.stream(**known, **extra) as s:
            events = list(s)
            msg = s.get_final_message()
        assert [e.type for e in events][:1] == ["message_start"] and events[-1].type == "message_stop"
    else:
        raw = client.beta.messages.with_raw_response.create(**known, **extra)
        assert raw.headers[MAX_TOKENS_HEADER] == str(CONTEXT - n)
        msg = raw.parse()
    assert msg.model == engine.info.target  # the model that answered, not the name asked
    assert [c.type for c in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "Plan." and msg.content[1].text == "I will read it."
    assert (msg.content[2].name, msg.content[2].input) == ("Read", {"file_path": "notes.txt"})
    assert msg.stop_reason == "tool_use"
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == n
    limits = msg.model_extra["limits"] if not stream else None
    if limits is not None:
        assert limits == {
            "context_length": CONTEXT,
            "prompt_tokens": n,
            "max_tokens": 32000,
            "max_tokens_allowed": CONTEXT - n,
        }


def test_claude_code_billing_block_and_system_entry_reach_the_template_as_meant():
    """The billing block is dropped (it changes every request and would end the shared prefix);
    the system entry inside messages is a system message where it stands."""
    req = anthropic_req(body("claude_code_messages.json"))
    assert req.messages[0]["role"] == "system" and "billing" not in req.messages[0]["content"]
    assert req.messages[0]["content"] == "You are a synthetic coding agent.\nAnswer briefly. Use the tools."
    assert [m["role"] for m in req.messages] == ["system", "user", "system"]
    assert req.messages[2]["content"] == "Synthetic agent list: general, explore."
    assert req.max_tokens == 32000 and req.template_kwargs is None  # adaptive: the template's own default
    # a system entry before the first turn joins the system prompt
    lead = api.MessagesRequest.model_validate(
        {
            "max_tokens": 5,
            "system": "A",
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "B"}]},
                {"role": "user", "content": "hi"},
            ],
        }
    )
    assert lead.to_engine(CONTEXT, NO_DEFAULTS).messages[:2] == [
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": "hi"},
    ]


# -- OpenCode: OpenAI chat completions through @ai-sdk/openai-compatible ---------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("limit", ["max_tokens", "max_completion_tokens"])
def test_opencode_request_is_answered_and_parsed_by_the_sdk(engine, url, stream, limit):
    b = body("opencode_chat.json")
    assert len(b["tools"]) == 10 and b["max_tokens"] == 32000 and b["stream_options"] == {"include_usage": True}
    b[limit] = b.pop("max_tokens")
    n = script(engine, openai_req(b), "Reading.</think>" + READ_OC)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    kw = {k: v for k, v in b.items() if k not in ("stream", "stream_options")}
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**kw, parallel_tool_calls=True)
        assert raw.headers[MAX_TOKENS_HEADER] == str(CONTEXT - n)
        r = raw.parse()
        assert r.model == engine.info.target and r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
        assert r.usage.prompt_tokens == n and r.model_extra["limits"]["max_tokens_allowed"] == CONTEXT - n
    else:
        chunks = list(
            client.chat.completions.create(
                **kw, stream=True, stream_options=b["stream_options"], parallel_tool_calls=True
            )
        )
        assert {c.model for c in chunks} == {engine.info.target}
        calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert len(calls) == 1
        call = calls[0]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert chunks[-1].usage.prompt_tokens == n and chunks[-1].choices == []
    assert call.function.name == "read" and json.loads(call.function.arguments) == {"arg": "notes.txt"}


def test_opencode_title_request_without_tools_streams_text(engine, url):
    b = body("opencode_title.json")
    assert b["tools"] == []
    script(engine, openai_req(b), "Done.</think>Greeting")
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=b, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate_json(e) for e in events[:-1]]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Greeting"
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices) == "Done."


# -- any model name, aliases, strict ---------------------------------------------------------------


def test_any_model_name_reaches_the_pair_and_aliases_are_listed(engine):
    target = engine.info.target
    with serve_in_thread(create_app(engine, names=ModelNames(("coder",)))) as u:
        cards = httpx.get(f"{u}/v1/models").json()["data"]
        assert [c["id"] for c in cards] == [target, "coder"] and {c["root"] for c in cards} == {target}
        assert httpx.get(f"{u}/v1/models/gpt-4o").json()["id"] == target
        assert httpx.get(f"{u}/v1/models/coder").json()["id"] == "coder"
        for name in ("gpt-4o", "claude-sonnet-4-6", "coder", None):
            req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            script(engine, openai_req(req), "Hey")
            r = httpx.post(f"{u}/v1/chat/completions", json={**req, "model": name})
            assert r.status_code == 200 and r.json()["model"] == target, (name, r.text)
        a = {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}}
        script(engine, anthropic_req(a), "Hey")
        r = httpx.post(f"{u}/v1/messages", json={**a, "model": "claude-opus-4-8"})
        assert r.status_code == 200 and r.json()["model"] == target


def test_strict_model_name_refuses_other_names_in_each_api_shape(engine):
    target = engine.info.target
    with serve_in_thread(create_app(engine, names=ModelNames(("coder",), strict=True))) as u:
        r = httpx.post(
            f"{u}/v1/chat/completions", json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "gpt-4o" in r.json()["error"]["message"] and "coder" in r.json()["error"]["message"]
        r = httpx.post(
            f"{u}/v1/messages",
            json={"model": "claude-x", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
        assert httpx.get(f"{u}/v1/models/gpt-4o").status_code == 404
        for name in ("coder", target, Path(target).name):
            req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            script(engine, openai_req(req), "Hey")
            assert httpx.post(f"{u}/v1/chat/completions", json={**req, "model": name}).status_code == 200, name


# -- max_tokens is an upper bound; a prompt over the context is a 400 naming both sizes --------------


def test_max_tokens_stops_where_the_context_ends_in_both_apis(engine, url):
    long = "word " * 400  # more than the context leaves after the prompt
    o = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 32000}
    n = script(engine, openai_req(o), long)
    r = httpx.post(f"{url}/v1/chat/completions", json=o, timeout=60)
    j = r.json()
    assert r.status_code == 200 and j["choices"][0]["finish_reason"] == "length"
    assert j["usage"]["completion_tokens"] == CONTEXT - n == int(r.headers[MAX_TOKENS_HEADER])
    assert j["limits"] == {
        "context_length": CONTEXT,
        "prompt_tokens": n,
        "max_tokens": 32000,
        "max_tokens_allowed": CONTEXT - n,
    }
    # below the room, max_tokens itself is what is allowed
    r = httpx.post(f"{url}/v1/chat/completions", json={**o, "max_tokens": 7}).json()
    assert r["usage"]["completion_tokens"] == 7 and r["limits"]["max_tokens_allowed"] == 7
    a = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 32000, "thinking": {"type": "disabled"}}
    n = script(engine, anthropic_req(a), long)
    with httpx.stream("POST", f"{url}/v1/messages", json={**a, "stream": True}, timeout=60) as r:
        assert int(r.headers[MAX_TOKENS_HEADER]) == CONTEXT - n
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == CONTEXT - n
    assert delta["limits"]["max_tokens_allowed"] == CONTEXT - n


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_over_the_context_is_refused_naming_prompt_and_context(engine, url, stream):
    big = "a" * (CONTEXT + 100)
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": big}], "max_tokens": 32000, "stream": stream},
        timeout=60,
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    prompt = script(engine, openai_req({"messages": [{"role": "user", "content": big}]}), "")
    assert f"{prompt} tokens" in err["message"] and str(CONTEXT) in err["message"]
    r = httpx.post(
        f"{url}/v1/messages",
        json={"messages": [{"role": "user", "content": big}], "max_tokens": 32000, "stream": stream},
        timeout=60,
    )
    j = r.json()
    assert r.status_code == 400 and j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
    assert "prompt is too long" in j["error"]["message"] and str(CONTEXT) in j["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_fields_agents_send_are_accepted(engine, url):
    """Fields a local model cannot use are accepted and ignored, never a 400."""
    o = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}
        ],
        "max_tokens": 4,
        "parallel_tool_calls": False,
        "store": False,
        "user": "u1",
        "metadata": {"k": "v"},
        "reasoning_effort": "low",
        "service_tier": "auto",
        "some_future_field": {"x": 1},
    }
    script(engine, openai_req(o), "Hey")
    assert httpx.post(f"{url}/v1/chat/completions", json=o).status_code == 200
    for thinking in ({"type": "adaptive"}, {"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}):
        a = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "thinking": thinking,
            "context_management": {"edits": []},
            "output_config": {"effort": "low"},
            "metadata": {"user_id": "u"},
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
            "some_future_field": 1,
        }
        script(engine, anthropic_req(a), "Hey")
        r = httpx.post(f"{url}/v1/messages?beta=true", json=a, headers={"anthropic-beta": "context-1m-2025-08-07"})
        assert r.status_code == 200, (thinking, r.text)


# -- the speculative tiny pair: the clamp on the real decode path -----------------------------------


def test_speculative_pair_stops_at_the_context_end(tmp_path):
    with running_engine(tiny_engine_loader(tmp_path, context=64)) as e, serve_in_thread(create_app(e)) as u:
        r = httpx.post(
            f"{u}/v1/completions",
            json={"prompt": list(range(5, 45)), "max_tokens": 32000, "temperature": 0},
            timeout=60,
        )
        j = r.json()
        assert r.status_code == 200 and j["speculation"]["enabled"], r.text
        done, finish = j["usage"]["completion_tokens"], j["choices"][0]["finish_reason"]
        assert (finish, done) == ("length", 24) or (finish == "stop" and done < 24)  # (it may end itself)
        assert j["limits"]["max_tokens_allowed"] == 24 == int(r.headers[MAX_TOKENS_HEADER])
        r = httpx.post(f"{u}/v1/completions", json={"prompt": list(range(5, 69)), "max_tokens": 1})
        assert r.status_code == 400 and "64 tokens > 63 maximum" in r.json()["error"]["message"]
