"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) with the official
``anthropic`` SDK, and reasoning splitting (``thinking`` blocks, OpenAI ``reasoning_content``)
over HTTP with a real Engine. The target is the tiny model with scripted greedy choices (see
test_server_tools.ScriptedModel); its tokenizer has ``<think>`` markers and a tool-call format."""

import json
import random

from mlx_spec.server import anthropic as api
from mlx_spec.server.app import create_app
from mlx_spec.server.schemas import NO_DEFAULTS, ChatCompletionRequest, RequestDefaults
from mlx_spec.text import encode_prompt
from mlx_spec.thinking import ThinkFormat, ThinkSplitter, prompt_opens_reasoning, split

import anthropic
import httpx
import openai
import pytest
from helpers import save_tiny_pair, save_tiny_tokenizer
from test_server import serve_in_thread
from test_server_tools import scripted_engine

# Qwen3.5-style: the generation prompt opens the reasoning block unless thinking is switched off.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}"
    "{% for tc in m.get('tool_calls') or [] %}{% set tool_call = tc['function'] %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}"
    "{% endif %}"
)
WEATHER = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "cache_control": {"type": "ephemeral"},
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
MSG = [{"role": "user", "content": "weather in Paris?"}]
OFF = {"type": "disabled"}
THINK = ThinkFormat()


# -- the splitter, pure --------------------------------------------------------------------------


def test_splitter_any_chunking():
    text = "<think>\nplan a</thi nk> b</think>\n\nThe answer <th is 4.<think>more</think>end"
    want = ("plan a</thi nk> bmore", "The answer <th is 4.end")
    assert split(THINK, text) == want
    rng = random.Random(0)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 15)))
        s = ThinkSplitter(THINK)
        items = [x for a, b in zip([0] + cuts, cuts + [len(text)]) for x in s.feed(text[a:b])] + s.finish()
        assert "".join(t for k, t in items if k == "reasoning") == want[0]
        assert "".join(t for k, t in items if k == "content") == want[1]
        assert not any("<think>" in t or "</think>" in t for _, t in items)


def test_splitter_prompt_opened_block_and_unclosed():
    assert split(THINK, "step 1\nstep 2</think>\n\nDone.", in_reasoning=True) == ("step 1\nstep 2", "Done.")
    assert split(THINK, "still thinking", in_reasoning=True) == ("still thinking", "")  # cut by max_tokens
    assert split(THINK, "no tags at all") == ("", "no tags at all")
    s = ThinkSplitter(THINK, in_reasoning=True)
    assert s.feed("abc</th") == [("reasoning", "abc")]  # a partial end marker is held
    assert s.feed("ink>x") == [("content", "x")]
    assert prompt_opens_reasoning(THINK, "<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning(THINK, "assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning(THINK, "assistant\n") and not prompt_opens_reasoning(None, "<think>")


# -- request mapping, pure -----------------------------------------------------------------------


def _engine_request(body: dict, defaults=NO_DEFAULTS):
    return api.MessagesRequest.model_validate({"max_tokens": 16, **body}).to_engine(4096, defaults)


def test_blocks_map_to_template_messages():
    req = _engine_request(
        {
            "system": [
                {"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "B"},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "x"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "calling"},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "rain"}],
                        },
                        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                        {"type": "text", "text": "and?"},
                    ],
                },
            ],
            "tools": WEATHER,
            "thinking": {"type": "enabled", "budget_tokens": 2048},
            "metadata": {"user_id": "u"},
            "service_tier": "auto",
            "top_k": 5,
        }
    )
    assert req.messages == [
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "calling",
            "reasoning_content": "hmm",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "user", "content": "and?"},
    ]
    assert req.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": WEATHER[0]["input_schema"],
            },
        }
    ]
    assert req.template_kwargs == {"enable_thinking": True} and req.top_k == 5
    assert (req.temperature, req.top_p, req.max_tokens) == (1.0, 1.0, 16)  # the API's defaults
    # the server's defaults apply where the body is silent; the body wins where it speaks
    d = RequestDefaults(temperature=0.0, top_p=0.9, top_k=20, template_kwargs={"enable_thinking": False})
    req = _engine_request({"messages": MSG}, d)
    assert (req.temperature, req.top_p, req.top_k, req.template_kwargs) == (0.0, 0.9, 20, {"enable_thinking": False})
    req = _engine_request(
        {"messages": MSG, "temperature": 0.5, "thinking": {"type": "enabled", "budget_tokens": 1024}}, d
    )
    assert req.temperature == 0.5 and req.template_kwargs == {"enable_thinking": True}
    assert _engine_request({"messages": MSG, "tools": WEATHER, "tool_choice": {"type": "none"}}).tools is None


@pytest.mark.parametrize(
    "body, where",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
            "unknown content block type 'video'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "image blocks are not supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
            "a user message cannot hold a tool_use block",
        ),
        ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "needs a string 'type'"),
        ({"messages": MSG, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "Anthropic-hosted"),
        ({"messages": MSG, "tools": [{"name": "f"}]}, "input_schema"),
        ({"messages": MSG, "tools": WEATHER, "tool_choice": {"type": "any"}}, "cannot be forced"),
        ({"messages": MSG, "thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"messages": MSG, "system": [{"type": "image"}]}, "system[0]: expected a text block"),
    ],
)
def test_bad_requests_are_refused_by_name(body, where):
    with pytest.raises(api.InvalidField) as e:
        _engine_request(body)
    assert where in str(e.value)


# -- end to end over HTTP --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    t, _ = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    save_tiny_tokenizer(t, extra_specials=("<think>", "</think>"), template=TEMPLATE)

    with scripted_engine(t) as e:
        yield e


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(create_app(engine)) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)


def say(engine, body: dict, text: str) -> int:
    """Script the target: after the prompt of this Anthropic request it says ``text``; returns the
    prompt's token count."""
    req = _engine_request(body)

    def fn(pair):
        ids = encode_prompt(pair.tokenizer, None, req.messages, tools=req.tools, template_kwargs=req.template_kwargs)
        pair.model.prompt_len = len(ids)
        pair.model.tokens = list(pair.tokenizer.encode(text, add_special_tokens=False))
        return len(ids)

    return engine.call(fn).result(30)


def test_engine_knows_the_markers(engine):
    assert engine.think_format == THINK and engine.tool_format is not None


def test_non_stream_thinking_text_and_usage(engine, client):
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    n = say(engine, {"messages": MSG, "system": system}, "Easy.</think>It is sunny.")
    r = client.messages.create(
        model="target",
        max_tokens=64,
        system=system,
        messages=MSG,
        metadata={"user_id": "u1"},
        service_tier="auto",
        extra_body={"temperature": 0},
    )
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "Easy." and r.content[1].text == "It is sunny."
    assert r.stop_reason == "end_turn" and r.stop_sequence is None and r.role == "assistant"
    assert r.id.startswith("msg_") and r.model == engine.info.target
    assert r.usage.input_tokens == n and r.usage.cache_read_input_tokens == 0
    assert r.usage.output_tokens == len("Easy.</think>It is sunny.") - len("</think>") + 2  # + marker + EOS
    assert r.model_extra["speculation"]["method"] == "plain" and "draft_n" in r.model_extra["timings"]
    # thinking switched off: the template closes the block in the prompt; all is text
    say(engine, {"messages": MSG, "thinking": OFF}, "Sunny.")
    r = client.messages.create(model="target", max_tokens=64, messages=MSG, thinking=OFF)
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "Sunny."


def test_stop_sequences_and_max_tokens(engine, client):
    say(engine, {"messages": MSG, "thinking": OFF}, "One. STOP two.")
    r = client.messages.create(
        model="target", max_tokens=64, messages=MSG, thinking=OFF, stop_sequences=["STOP", "xyz"]
    )
    assert r.content[0].text == "One. " and r.stop_reason == "stop_sequence" and r.stop_sequence == "STOP"
    r = client.messages.create(model="target", max_tokens=3, messages=MSG, thinking=OFF)
    assert r.content[0].text == "One" and r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


def test_tools_round_trip(engine, client):
    body = {"messages": MSG, "tools": WEATHER}
    say(engine, body, "Need data.</think>Let me check." + CALL)
    r = client.messages.create(
        model="target", max_tokens=200, messages=MSG, tools=WEATHER, tool_choice={"type": "auto"}
    )
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use"] and r.stop_reason == "tool_use"
    use = r.content[2]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    # the agent's next turn: the reply goes back as it came, then the tool's result
    turn2 = MSG + [
        r.to_param(),
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": "sunny",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
    ]
    turn2 = json.loads(json.dumps(turn2, default=lambda o: o.model_dump()))
    say(engine, {**body, "messages": turn2}, "Done.</think>It is sunny.")
    r2 = client.messages.create(model="target", max_tokens=200, messages=turn2, tools=WEATHER)
    assert [b.type for b in r2.content] == ["thinking", "text"] and r2.content[1].text == "It is sunny."
    assert r2.stop_reason == "end_turn"


def test_stream_events(engine, client, url):
    body = {"messages": MSG, "tools": WEATHER}
    say(engine, body, "Need data.</think>Let me check." + CALL)
    # on the wire: named SSE events, a ping right after message_start (the SDK hides pings)
    raw = httpx.post(f"{url}/v1/messages", json={"model": "target", "max_tokens": 200, "stream": True, **body}).text
    names = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"
    assert all(line.startswith(("event: ", "data: ")) for line in raw.splitlines() if line)
    events = list(client.messages.create(model="target", max_tokens=200, messages=MSG, tools=WEATHER, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert kinds.count("content_block_stop") == 3 and [e.index for e in events if e.type == "content_block_stop"] == [
        0,
        1,
        2,
    ]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == "Let me check."  # the call's text never streamed as text
    (js,) = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert json.loads(js) == {"city": "Paris"}
    delta = events[-2]
    assert delta.delta.stop_reason == "tool_use" and delta.usage.output_tokens > 0
    assert delta.model_extra["speculation"]["method"] == "plain"
    # the SDK's own accumulator gives the same message as the non-stream route
    with client.messages.stream(model="target", max_tokens=200, messages=MSG, tools=WEATHER) as s:
        final = s.get_final_message()
    r = client.messages.create(model="target", max_tokens=200, messages=MSG, tools=WEATHER)

    def same(blocks):  # tool_use ids are fresh per reply
        return [b.model_dump(exclude={"id"}) for b in blocks]

    assert same(final.content) == same(r.content)
    assert final.stop_reason == r.stop_reason and final.usage.output_tokens == r.usage.output_tokens
    assert final.usage.input_tokens == r.usage.input_tokens


def test_count_tokens(engine, client):
    n = say(engine, {"messages": MSG, "tools": WEATHER, "system": "S"}, "x")
    got = client.messages.count_tokens(model="target", messages=MSG, tools=WEATHER, system="S")
    assert got.input_tokens == n
    assert client.messages.count_tokens(model="target", messages=MSG).input_tokens < n


def test_errors_in_anthropic_shape_and_server_keeps_serving(engine, client, url):
    r = httpx.post(f"{url}/v1/messages", json={"model": "target", "messages": MSG})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model="target", max_tokens=10, messages=[{"role": "user", "content": [{"type": "video", "src": "x"}]}]
        )
    assert e.value.body["error"]["type"] == "invalid_request_error" and "video" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # a prompt that fills the context alone
        client.messages.create(model="target", max_tokens=10, messages=[{"role": "user", "content": "a" * 5000}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "prompt is too long" in e.value.body["error"]["message"]
    r = httpx.post(f"{url}/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.get(f"{url}/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    # the OpenAI routes keep their own shape
    assert "type" not in httpx.post(f"{url}/v1/chat/completions", json={}).json()
    say(engine, {"messages": MSG, "thinking": OFF}, "Still here.")
    r = client.messages.create(model="target", max_tokens=20, messages=MSG, thinking=OFF)
    assert r.content[0].text == "Still here."
    metrics = httpx.get(f"{url}/metrics").text
    assert 'route="/v1/messages",status="200"' in metrics and 'route="/v1/messages",status="400"' in metrics


def test_x_api_key(engine):
    with serve_in_thread(create_app(engine, api_key="sekret")) as u:
        ok = anthropic.Anthropic(base_url=u, api_key="sekret", max_retries=0, timeout=60)
        say(engine, {"messages": MSG, "thinking": OFF}, "Hi.")
        assert ok.messages.create(model="target", max_tokens=9, messages=MSG, thinking=OFF).content[0].text == "Hi."
        assert ok.messages.count_tokens(model="target", messages=MSG).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=u, api_key="wrong", max_retries=0).messages.create(
                model="target", max_tokens=9, messages=MSG
            )
        assert e.value.body["error"]["type"] == "authentication_error"
        # x-api-key works on the OpenAI routes too; Bearer still works
        assert httpx.get(f"{u}/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
        assert httpx.get(f"{u}/v1/models", headers={"authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(f"{u}/v1/models", headers={"x-api-key": "nope"}).status_code == 401


# -- OpenAI: reasoning_content and chat_template_kwargs -------------------------------------------


def say_openai(engine, messages, text, template_kwargs=None) -> None:
    req = ChatCompletionRequest.model_validate({"messages": messages, "chat_template_kwargs": template_kwargs})
    req = req.to_engine(4096)

    def fn(pair):
        ids = encode_prompt(pair.tokenizer, None, req.messages, template_kwargs=req.template_kwargs)
        pair.model.prompt_len = len(ids)
        pair.model.tokens = list(pair.tokenizer.encode(text, add_special_tokens=False))

    engine.call(fn).result(30)


def test_openai_reasoning_content(engine, url):
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    say_openai(engine, MSG, "Think first.</think>\nAnswer.")
    r = oa.chat.completions.create(model="target", messages=MSG, temperature=0)
    msg = r.choices[0].message
    assert msg.content == "Answer." and msg.model_extra["reasoning_content"] == "Think first."
    chunks = list(oa.chat.completions.create(model="target", messages=MSG, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "Think first."
    assert "".join(d.content or "" for d in deltas) == "Answer."
    assert not any("think>" in (d.content or "") for d in deltas)
    # chat_template_kwargs switch thinking off: no reasoning, no key
    say_openai(engine, MSG, "Plain.", {"enable_thinking": False})
    r = oa.chat.completions.create(
        model="target", messages=MSG, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert r.choices[0].message.content == "Plain." and "reasoning_content" not in (
        r.choices[0].message.model_extra or {}
    )
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model="target", messages=MSG, extra_body={"chat_template_kwargs": "x"})


def test_server_defaults_fill_omitted_fields(engine):
    d = RequestDefaults(max_tokens=2, temperature=0.0, template_kwargs={"enable_thinking": False})
    say_openai(engine, MSG, "Plain answer.", {"enable_thinking": False})
    with serve_in_thread(create_app(engine, defaults=d)) as u:
        oa = openai.OpenAI(base_url=f"{u}/v1", api_key="none", max_retries=0, timeout=60)
        r = oa.chat.completions.create(model="target", messages=MSG)  # no max_tokens, no temperature
        assert r.choices[0].message.content == "Pl" and r.choices[0].finish_reason == "length"
        r = oa.chat.completions.create(model="target", messages=MSG, max_tokens=4)
        assert r.choices[0].message.content == "Plai"


def test_generate_think_flag_sets_the_template_switch(tmp_path, capsys):
    from mlx_spec.cli import main

    t, _ = save_tiny_pair(tmp_path)
    save_tiny_tokenizer(t, extra_specials=("<think>", "</think>"), template=TEMPLATE)
    counts = {}
    for flag in ("--think", "--no-think"):
        assert (
            main(
                [
                    "generate",
                    "--target",
                    str(t),
                    "--no-draft",
                    "--chat",
                    "--prompt",
                    "hi",
                    "--max-tokens",
                    "2",
                    "--json",
                    flag,
                ]
            )
            == 0
        )
        counts[flag] = json.loads(capsys.readouterr().out)["prompt_tokens"]
    assert counts["--no-think"] == counts["--think"] + 1  # "<think></think>" closes the block in the prompt
