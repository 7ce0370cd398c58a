"""Real-client tests: the official `anthropic` and `openai` SDKs against a live zerolayer node.

Run by tests/tests/clients.rs (cargo test), which starts the server on the real model and
passes its address in ZEROLAYER_BASE_URL. Exits non-zero on the first failure.
"""
import os

import anthropic
import openai

import runner

BASE = os.environ["ZEROLAYER_BASE_URL"]
MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0}

ac = anthropic.Anthropic(base_url=BASE, api_key="test-key", max_retries=0, timeout=120)
oc = openai.OpenAI(base_url=BASE + "/v1", api_key="test-key", max_retries=0, timeout=120)


def text_of(msg):
    return "".join(b.text for b in msg.content if b.type == "text")


def test_create_with_system_and_history():
    msg = ac.messages.create(
        model=MODEL,
        max_tokens=24,
        system="You are a helpful assistant.",
        messages=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": "Nice to meet you, Ada!"},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        extra_body=GREEDY,
    )
    assert msg.type == "message" and msg.role == "assistant", msg
    assert msg.id.startswith("msg_")
    assert len(text_of(msg)) > 0
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens > 0
    # The whole history reached the model: the prompt is exactly what count_tokens says for
    # the same system prompt and turns, and longer than the last turn alone.
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada!"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    full = ac.messages.count_tokens(model=MODEL, system="You are a helpful assistant.", messages=history).input_tokens
    last = ac.messages.count_tokens(model=MODEL, system="You are a helpful assistant.", messages=history[-1:]).input_tokens
    used = msg.usage.input_tokens + msg.usage.cache_read_input_tokens + msg.usage.cache_creation_input_tokens
    assert used == full and full > last + 10, (used, full, last)


def test_assistant_prefill_is_continued():
    msg = ac.messages.create(
        model=MODEL,
        max_tokens=8,
        system="You are a helpful assistant.",
        messages=[
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"},
        ],
        extra_body=GREEDY,
    )
    t = text_of(msg)
    assert "Paris" in t, t
    assert not t.startswith("The capital"), "the prefill itself is not repeated: " + t


def test_stop_sequences():
    msg = ac.messages.create(
        model=MODEL,
        max_tokens=64,
        system="You are a helpful assistant.",
        messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        stop_sequences=["5"],
        extra_body=GREEDY,
    )
    assert msg.stop_reason == "stop_sequence", msg
    assert msg.stop_sequence == "5"
    assert "5" not in text_of(msg)


def test_max_tokens():
    msg = ac.messages.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Tell me a long story."}], extra_body=GREEDY
    )
    assert msg.stop_reason == "max_tokens", msg
    assert msg.usage.output_tokens == 3


def test_stream():
    chunks = []
    with ac.messages.stream(
        model=MODEL,
        max_tokens=20,
        system="You are a helpful assistant.",
        messages=[{"role": "user", "content": "Name three colors."}],
        extra_body=GREEDY,
    ) as stream:
        for t in stream.text_stream:
            chunks.append(t)
        final = stream.get_final_message()
    assert len(chunks) > 1, chunks
    assert "".join(chunks) == text_of(final)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0


def test_count_tokens():
    r = ac.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hello there"}])
    assert r.input_tokens > 3, r


def test_models_list():
    page = ac.models.list()
    ids = [m.id for m in page.data]
    assert MODEL in ids, ids
    m = ac.models.retrieve(MODEL)
    assert m.id == MODEL
    ids = [m.id for m in oc.models.list().data]
    assert MODEL in ids, ids


def test_malformed_request_raises_bad_request():
    try:
        ac.messages.create(model=MODEL, max_tokens=5, messages=[])
    except anthropic.BadRequestError as e:
        assert e.status_code == 400
        assert "messages" in str(e)
    else:
        raise AssertionError("expected BadRequestError")
    try:
        ac.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}], extra_body={"temperature": 3})
    except anthropic.BadRequestError as e:
        assert "temperature" in str(e)
    else:
        raise AssertionError("expected BadRequestError for temperature")


def test_unknown_model_raises_not_found():
    try:
        ac.messages.create(model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    except anthropic.NotFoundError as e:
        assert e.status_code == 404
    else:
        raise AssertionError("expected NotFoundError")


def test_openai_chat_plain_and_streamed():
    msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is the capital of France?"}]
    r = oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    plain = r.choices[0].message.content
    assert "Paris" in plain, plain
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
    parts = []
    for chunk in oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    assert "".join(parts) == plain, (parts, plain)


if __name__ == "__main__":
    runner.run(globals())
