"""Tool calls: the text -> ``tool_calls`` machine (pure, stream and non-stream), and end to end
over HTTP with a real Engine whose tokenizer has mlx-lm's json_tools format and whose target
says a scripted text (a plain pair; only the model's greedy choice is scripted)."""

import json
import random
from dataclasses import replace
from types import SimpleNamespace

from mlx_spec.engine import Delta, Done, Handle, Started
from mlx_spec.generation import EngineInfo, engine_info
from mlx_spec.loading import load_pair
from mlx_spec.server import tools
from mlx_spec.server.app import create_app
from mlx_spec.server.tools import ToolCallStream, ToolFormat
from mlx_spec.session import Session
from mlx_spec.stats import StatsSnapshot
from mlx_spec.text import encode_prompt

import httpx
import mlx.core as mx
import openai
import pytest
from helpers import save_tiny_pair
from mlx_lm.tool_parsers import json_tools, mistral
from test_server import running_engine, serve_in_thread

JSON = ToolFormat("<tool_call>", "</tool_call>", json_tools.parse_tool_call)
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
BAD = '<tool_call>{"name": "get_weather", oops}</tool_call>'


def _fn(call: dict) -> tuple[str, dict]:
    return call["function"]["name"], json.loads(call["function"]["arguments"])


# -- the machine, as pure functions ----------------------------------------------------------


def test_split_content_and_calls():
    content, calls = tools.split(JSON, "Let me check." + CALL, WEATHER)
    assert content == "Let me check."
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert _fn(calls[0]) == ("get_weather", {"city": "Paris"})
    assert set(calls[0]) == {"id", "type", "function"}
    # two calls, nothing else: empty content; ids differ
    content, calls = tools.split(JSON, CALL + "\n" + CALL.replace("Paris", "Oslo"), WEATHER)
    assert content == "\n" and [_fn(c)[1]["city"] for c in calls] == ["Paris", "Oslo"]
    assert calls[0]["id"] != calls[1]["id"]
    # no marker: the text is untouched
    assert tools.split(JSON, "plain <tool answer", WEATHER) == ("plain <tool answer", [])


def test_unparseable_call_stays_text():
    text = "a" + BAD + "b"
    assert tools.split(JSON, text, WEATHER) == (text, [])
    content, calls = tools.split(JSON, BAD + CALL, WEATHER)  # a bad call does not hide a good one
    assert content == BAD and len(calls) == 1
    # a parser that returns nonsense (no name) or raises anything is not a 500
    weird = ToolFormat("<tool_call>", "</tool_call>", lambda text, tools: {"arguments": {}})
    assert tools.split(weird, CALL, WEATHER) == (CALL, [])
    boom = ToolFormat("<tool_call>", "</tool_call>", lambda text, tools: 1 / 0)
    assert tools.split(boom, CALL, WEATHER) == (CALL, [])


def test_unterminated_call():
    # cut short after a complete JSON object: parsed (as mlx-lm does); cut mid-JSON: text
    content, calls = tools.split(JSON, "x" + CALL[: -len("</tool_call>")], WEATHER)
    assert content == "x" and _fn(calls[0])[0] == "get_weather"
    cut = "x" + CALL[:30]
    assert tools.split(JSON, cut, WEATHER) == (cut, [])


def test_end_marker_empty_and_list_parsers():
    """Mistral's format has no end marker and one start may hold several calls."""
    fmt = ToolFormat("[TOOL_CALLS]", "", mistral.parse_tool_call)
    content, calls = tools.split(
        fmt, 'ok[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}get_weather[ARGS]{"city": "Bern"}', WEATHER
    )
    assert content == "ok" and [_fn(c) for c in calls] == [
        ("get_weather", {"city": "Rome"}),
        ("get_weather", {"city": "Bern"}),
    ]
    # the model's own id is kept; otherwise call_<hex>
    content, calls = tools.split(fmt, '[TOOL_CALLS][{"name": "f", "arguments": {}, "id": "abc123XYZ"}]', None)
    assert content == "" and calls[0]["id"] == "abc123XYZ" and calls[0]["function"]["arguments"] == "{}"


def _run_stream(fmt, pieces, tools_=WEATHER):
    s = ToolCallStream(fmt, tools_)
    out = []
    for p in pieces:
        out.append(s.feed(p))
    out.append(s.finish())
    return out


def test_stream_holds_call_text_for_any_chunking():
    text = "Sure. " + CALL + " and " + BAD + " then " + CALL.replace("Paris", "Lima") + " done <tool"
    want_content, want_calls = tools.split(JSON, text, WEATHER)
    rng = random.Random(0)
    cuttings = [list(text)]  # one character at a time: every marker is split
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        cuttings.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for pieces in cuttings:
        items = [x for batch in _run_stream(JSON, pieces) for x in batch]
        texts = [x for x in items if isinstance(x, str)]
        calls = [x for x in items if isinstance(x, dict)]
        assert "".join(texts) == want_content
        assert [c["index"] for c in calls] == [0, 1]
        assert [_fn(c) for c in calls] == [_fn(c) for c in want_calls]
        # nothing of a good call is ever streamed as content
        assert not any('"Paris"' in t or '"Lima"' in t for t in texts)


def test_stream_order_and_hold_back():
    batches = _run_stream(
        JSON, ["Hi <to", "ol_call>", '{"name": "get_weather", "arguments": {}}</tool', "_call>after <to", "ast>"]
    )
    assert batches[0] == ["Hi "]  # "<to" may start a marker: held
    assert batches[1] == [] and batches[2] == []  # inside the call: held
    assert batches[3][0]["function"]["name"] == "get_weather" and batches[3][1] == "after "
    assert batches[4] == ["<toast>"] and batches[5] == []  # "<toast" was no marker after all
    assert _run_stream(JSON, ["trailing <tool_"]) == [["trailing "], ["<tool_"]]  # flushed at the end


def test_tool_format_from_tokenizer():
    assert tools.tool_format(None) is None
    assert tools.tool_format(SimpleNamespace(has_tool_calling=False)) is None
    parse = json_tools.parse_tool_call
    fmt = tools.tool_format(
        SimpleNamespace(has_tool_calling=True, tool_call_start="[TOOL_CALLS]", tool_call_end=None, tool_parser=parse)
    )
    assert fmt == ToolFormat("[TOOL_CALLS]", "", parse)
    assert tools.finish_reason("stop", True) == "tool_calls"
    assert tools.finish_reason("length", True) == "length" and tools.finish_reason("stop", False) == "stop"


# -- end to end over HTTP ----------------------------------------------------------------------

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}\n"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for tc in m.get('tool_calls') or [] %}{% set tool_call = tc['function'] %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments }}}</tool_call>'
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ScriptedModel:
    """The tiny target, run as usual (its caches advance), whose logits are replaced so the
    greedy continuation of a ``prompt_len``-token prompt is ``tokens`` then EOS."""

    def __init__(self, inner, eos: int):
        self.inner, self.eos, self.args, self.layers = inner, eos, inner.args, inner.layers
        self.prompt_len, self.tokens = 0, []

    def __call__(self, inputs, cache=None, **kw):
        start = cache[0].offset
        logits = self.inner(inputs, cache=cache, **kw)
        want = mx.array([self._next(start + i) for i in range(inputs.shape[1])])
        return mx.where(mx.arange(logits.shape[-1])[None] == want[:, None], 100.0, -100.0)[None]

    def _next(self, pos: int) -> int:
        k = pos + 1 - self.prompt_len
        return self.tokens[k] if 0 <= k < len(self.tokens) else self.eos


def scripted_engine(target_dir):
    """A running Engine over the target in ``target_dir`` alone (no drafter), its greedy choice
    scripted by ``ScriptedModel``."""

    def loader():
        pair = load_pair(str(target_dir), None, no_draft=True)
        pair = replace(pair, model=ScriptedModel(pair.model, pair.tokenizer.eos_token_id))
        return Session.of(pair, engine_info(pair))

    return running_engine(loader)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from transformers import AutoTokenizer

    t, _ = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    tok = AutoTokenizer.from_pretrained(str(t))
    tok.chat_template = TOOL_TEMPLATE  # has <tool_call> and tool_call.name: mlx-lm infers json_tools
    tok.save_pretrained(str(t))

    with scripted_engine(t) as e:
        yield e


@pytest.fixture(scope="module")
def client(engine):
    with serve_in_thread(create_app(engine)) as u:
        yield openai.OpenAI(base_url=f"{u}/v1", api_key="none", max_retries=0, timeout=60)


def say(engine, messages, text, tools_=None) -> int:
    """Script the target: after this conversation's prompt it says ``text``; returns its tokens."""

    def fn(pair):
        ids = encode_prompt(pair.tokenizer, None, messages, tools=tools_)
        pair.model.prompt_len = len(ids)
        pair.model.tokens = list(pair.tokenizer.encode(text, add_special_tokens=False))
        return len(pair.model.tokens)

    return engine.call(fn).result(30)


MSG = [{"role": "user", "content": "weather in Paris?"}]


def test_engine_captures_the_tokenizer_format(engine):
    fmt = engine.tool_format
    assert fmt == ToolFormat("<tool_call>", "</tool_call>", json_tools.parse_tool_call)


def test_non_stream_tool_call_over_http(engine, client):
    say(engine, MSG, "Let me check." + CALL, WEATHER)
    r = client.chat.completions.create(model="target", messages=MSG, tools=WEATHER, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the agent's next turn: the assistant message with its tool_calls goes back through the template
    turn2 = MSG + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    say(engine, turn2, "It is sunny.", WEATHER)
    r2 = client.chat.completions.create(model="target", messages=turn2, tools=WEATHER, temperature=0)
    assert r2.choices[0].message.content == "It is sunny." and r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.tool_calls is None
    # a call the parser cannot read comes back as text
    say(engine, MSG, BAD, WEATHER)
    r3 = client.chat.completions.create(model="target", messages=MSG, tools=WEATHER, temperature=0)
    assert r3.choices[0].message.content == BAD and r3.choices[0].message.tool_calls is None
    assert r3.choices[0].finish_reason == "stop"
    # without tools in the request nothing changes: the text as the model wrote it
    say(engine, MSG, "Let me check." + CALL)
    r4 = client.chat.completions.create(model="target", messages=MSG, temperature=0)
    assert r4.choices[0].message.content == "Let me check." + CALL and r4.choices[0].finish_reason == "stop"


def test_stream_tool_call_over_http(engine, client):
    n = say(engine, MSG, "Let me check." + CALL + "\nSTOP here", WEATHER)
    chunks = list(
        client.chat.completions.create(
            model="target",
            messages=MSG,
            tools=WEATHER,
            temperature=0,
            stop=["STOP"],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    assert content == "Let me check.\n"  # the call's text never streamed; the stop string cut the rest
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "tool_calls"
    assert finals[0].model_extra["timings"]["predicted_n"] == chunks[-1].usage.completion_tokens
    assert chunks[-1].choices == [] and 0 < chunks[-1].usage.completion_tokens <= n + 1
    # the same, non-stream, agrees
    r = client.chat.completions.create(model="target", messages=MSG, tools=WEATHER, temperature=0, stop=["STOP"])
    assert r.choices[0].message.content == content and r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.arguments == calls[0].function.arguments


# -- a tokenizer without a tool-call format: today's behaviour (text) --------------------------


def _Info():
    return EngineInfo("plain", "fake", None, 1, "plain (--no-draft)", "plain")


class TextOnlyEngine:
    """The Engine interface, no tool format, scripted to 'say' a tool call in two pieces."""

    state, error, info, context_length, queue_depth, tool_format = "ready", None, _Info(), 1024, 0, None

    def submit(self, req, loop=None):
        h = Handle(req, loop)
        h._put(Started(req.id, 3, self.info))
        for piece in (CALL[:7], CALL[7:]):
            h._put(Delta(req.id, piece, (1,), 0, 0, StatsSnapshot()))
        h._put(Done(req.id, CALL, "stop", 3, 2, self.info, StatsSnapshot(), {"draft_n": 0}))
        return h


async def test_no_tool_format_keeps_text():
    app = create_app(TextOnlyEngine())
    body = {"messages": MSG, "tools": WEATHER}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = (await c.post("/v1/chat/completions", json=body)).json()
        assert r["choices"][0]["message"] == {"role": "assistant", "content": CALL}
        assert r["choices"][0]["finish_reason"] == "stop"
        s = await c.post("/v1/chat/completions", json={**body, "stream": True})
        events = [json.loads(e[6:]) for e in s.text.split("\n\n") if e.startswith("data: {")]
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == CALL
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        assert not any("tool_calls" in e["choices"][0]["delta"] for e in events)


def test_tool_choice_none_auto_and_refused(engine, client):
    # "none": the model is shown no tools (the prompt has none) and nothing is parsed
    say(engine, MSG, "Let me check." + CALL)
    r = client.chat.completions.create(model="target", messages=MSG, tools=WEATHER, tool_choice="none", temperature=0)
    assert r.choices[0].message.content == "Let me check." + CALL and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    say(engine, MSG, "Let me check." + CALL, WEATHER)
    r = client.chat.completions.create(model="target", messages=MSG, tools=WEATHER, tool_choice="auto", temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}, "sometimes"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="target", messages=MSG, tools=WEATHER, tool_choice=choice, temperature=0
            )
        assert e.value.body["param"] == "tool_choice"
    # the server keeps serving
    assert (
        client.chat.completions.create(model="target", messages=MSG, tools=WEATHER, temperature=0)
        .choices[0]
        .finish_reason
        == "tool_calls"
    )
