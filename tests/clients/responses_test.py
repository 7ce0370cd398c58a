"""The official `openai` Python SDK's Responses API against a live two-node zerolayer cluster.

Run by tests/tests/responses.rs, which starts the cluster on Qwen2.5-Coder-0.5B-Instruct and
passes node a's address in ZEROLAYER_BASE_URL and node b's in ZEROLAYER_OTHER_URL, with the
keys of two tenants (alice, bob).
"""
import json
import os

import jsonschema
import openai

import runner

MODEL = "qwen"
A = os.environ["ZEROLAYER_BASE_URL"] + "/v1"
B = os.environ["ZEROLAYER_OTHER_URL"] + "/v1"
ALICE, BOB = os.environ["ALICE_KEY"], os.environ["BOB_KEY"]


def client(base, key):
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=300)


alice_a, alice_b, bob_b = client(A, ALICE), client(B, ALICE), client(B, BOB)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
QUESTION = "What is the capital of France? Answer in one word."


def test_create_plain():
    r = alice_a.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=16)
    assert r.id.startswith("resp_") and r.object == "response", r
    assert r.status == "completed", r.status
    assert "Paris" in r.output_text, r.output_text
    assert r.usage.input_tokens > 10 and r.usage.output_tokens > 0, r.usage
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_stream_events_in_order_and_deltas_add_up():
    plain = alice_a.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=16, store=False)
    types, seqs, deltas = [], [], []
    with alice_a.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=16, store=False) as s:
        for ev in s:
            types.append(ev.type)
            seqs.append(ev.sequence_number)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = s.get_final_response()
    assert seqs == list(range(len(seqs))), seqs
    expected = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert types[:4] == expected, types
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert types[-4:] == tail, types
    assert set(types[4:-4]) == {"response.output_text.delta"}, types
    assert "".join(deltas) == final.output_text == plain.output_text, (deltas, final.output_text, plain.output_text)
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_forced_function_call_validates():
    r = alice_a.responses.create(model=MODEL, input="What's the weather like in Paris today?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0, store=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", r.output
    assert calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])


def test_streamed_function_call():
    types, args = [], []
    with alice_a.responses.stream(model=MODEL, input="What's the weather like in Paris today?", tools=[WEATHER],
                                  tool_choice="required", temperature=0, store=False) as s:
        for ev in s:
            types.append(ev.type)
            if ev.type == "response.function_call_arguments.delta":
                args.append(ev.delta)
        final = s.get_final_response()
    assert "response.function_call_arguments.done" in types and types[-1] == "response.completed", types
    call = next(o for o in final.output if o.type == "function_call")
    assert "".join(args) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_function_call_output_round_trip():
    question = {"role": "user", "content": "What's the weather like in Paris today?"}
    first = alice_a.responses.create(model=MODEL, input=[question], tools=[WEATHER], tool_choice="required", temperature=0, store=False)
    call = next(o for o in first.output if o.type == "function_call")
    items = [question, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees celsius and sunny"}]
    # Answered without tools (as tests/tests/tools.rs does): the 0.5B model, offered the tool
    # again, calls it again.
    second = alice_a.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=48, store=False)
    assert "18" in second.output_text, second.output_text


def test_previous_response_id_on_another_node():
    first = alice_a.responses.create(model=MODEL, input="My name is Ada. Please remember it.", temperature=0, max_output_tokens=24)
    second = alice_b.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name? Answer with the name only.",
                                      temperature=0, max_output_tokens=8)
    assert "Ada" in second.output_text, second.output_text
    covered = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > covered, (second.usage, first.usage)
    assert second.previous_response_id == first.id
    try:
        bob_b.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?", max_output_tokens=8)
        raise AssertionError("another tenant continued alice's response")
    except openai.NotFoundError as e:
        assert first.id in str(e), e


def test_retrieve_and_delete_from_another_node():
    r = alice_a.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=8)
    got = alice_b.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text, got
    for call in (lambda: bob_b.responses.retrieve(r.id), lambda: bob_b.responses.delete(r.id)):
        try:
            call()
            raise AssertionError("another tenant saw alice's response")
        except openai.NotFoundError:
            pass
    alice_b.responses.delete(r.id)
    try:
        alice_a.responses.retrieve(r.id)
        raise AssertionError("a deleted response was found")
    except openai.NotFoundError:
        pass


def test_bad_requests_get_clear_errors():
    orphan = [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "call_nope", "output": "x"}]
    for kwargs, says, error in [
        ({"input": orphan}, "No tool call found for function call output with call_id call_nope.", openai.BadRequestError),
        ({"input": "Hi", "previous_response_id": "resp_doesnotexist"}, "resp_doesnotexist", openai.NotFoundError),
        ({"input": "Hi", "temperature": 5}, "temperature", openai.BadRequestError),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "not supported", openai.BadRequestError),
    ]:
        try:
            alice_a.responses.create(model=MODEL, max_output_tokens=8, **kwargs)
            raise AssertionError(f"accepted {kwargs}")
        except error as e:
            assert says in str(e), (kwargs, str(e))
    try:
        alice_a.responses.create(model="no-such-model", input="Hi")
        raise AssertionError("an unknown model was served")
    except openai.NotFoundError:
        pass


def test_incomplete_at_the_length_limit():
    r = alice_a.responses.create(model=MODEL, input="Count from one to one hundred in words.", temperature=0, max_output_tokens=4, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
    assert r.usage.output_tokens == 4


if __name__ == "__main__":
    runner.run(globals())
