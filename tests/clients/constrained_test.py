"""Constrained decoding through the official `anthropic` and `openai` Python SDKs.

Run by tests/tests/constrained.rs against a node serving Qwen2.5-Coder-0.5B-Instruct. The cases
(five schema shapes, ten prompts each) are in constrained_cases.json. Every forced tool input and
every structured output must parse and validate against its schema: 50 of 50, streamed and not.
Exits non-zero on any failure.
"""
import json
import os
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai

import runner

BASE = os.environ["ZEROLAYER_BASE_URL"]
MODEL = os.environ.get("ZEROLAYER_MODEL", "qwen")
HERE = os.path.dirname(os.path.abspath(__file__))
CASES = json.load(open(os.path.join(HERE, "constrained_cases.json")))["schemas"]
# The Anthropic SDK takes no `temperature` argument: greedy decoding goes in the body.
GREEDY = {"temperature": 0}
# Requests in flight at once (the worker batches them).
PARALLEL = 4

ac = anthropic.Anthropic(base_url=BASE, api_key="test-key", max_retries=0, timeout=300)
oc = openai.OpenAI(base_url=BASE + "/v1", api_key="test-key", max_retries=0, timeout=300)


def cases():
    """(index, schema case, prompt) for all 50 prompts."""
    out = []
    for case in CASES:
        for p in case["prompts"]:
            out.append((len(out), case, p))
    return out


def tool_def(case):
    return {"name": case["tool"], "description": case["description"], "input_schema": case["schema"]}


def validate(instance, schema):
    jsonschema.Draft202012Validator(schema).validate(instance)


def run_all(f, items):
    """Runs f over items PARALLEL at a time; returns the failures as (item, error)."""
    def one(item):
        try:
            f(item)
            return None
        except Exception as e:  # noqa: BLE001 - every failure is reported
            return (item[0], item[2], repr(e))
    with ThreadPoolExecutor(PARALLEL) as pool:
        return [r for r in pool.map(one, items) if r is not None]


def forced_tool(item):
    i, case, prompt = item
    kw = dict(model=MODEL, max_tokens=256, extra_body=GREEDY, tools=[tool_def(case)],
              tool_choice={"type": "tool", "name": case["tool"]}, messages=[{"role": "user", "content": prompt}])
    if i % 2:
        with ac.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = ac.messages.create(**kw)
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use", (msg.stop_reason, msg.content)
    assert len(calls) == 1 and calls[0].name == case["tool"], msg.content
    assert calls[0].id.startswith("toolu_")
    validate(calls[0].input, case["schema"])


def test_anthropic_forced_tool_inputs_validate_50_of_50():
    failures = run_all(forced_tool, cases())
    assert not failures, f"{len(failures)}/50 failed: {failures}"


def structured(item):
    i, case, prompt = item
    kw = dict(model=MODEL, max_tokens=256, messages=[{"role": "user", "content": f"Answer in JSON. {prompt}"}],
              extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": case["schema"]}}})
    if i % 2:
        with ac.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = ac.messages.create(**kw)
    assert msg.stop_reason == "end_turn", (msg.stop_reason, msg.content)
    text = "".join(b.text for b in msg.content if b.type == "text")
    validate(json.loads(text), case["schema"])


def test_anthropic_structured_output_validates_50_of_50():
    failures = run_all(structured, cases())
    assert not failures, f"{len(failures)}/50 failed: {failures}"


def test_anthropic_tool_round_trip():
    weather = {"name": "get_weather", "description": "Get the current weather in a city",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    history = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = ac.messages.create(model=MODEL, max_tokens=128, extra_body=GREEDY, tools=[weather], tool_choice={"type": "any"}, messages=history)
    call = next(b for b in first.content if b.type == "tool_use")
    assert first.stop_reason == "tool_use" and call.name == "get_weather" and isinstance(call.input.get("city"), str), first.content
    history += [{"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees and sunny"}]}]
    final = ac.messages.create(model=MODEL, max_tokens=128, extra_body=GREEDY, tools=[weather], tool_choice={"type": "none"}, messages=history)
    text = "".join(b.text for b in final.content if b.type == "text")
    assert final.stop_reason == "end_turn" and "18" in text, (final.stop_reason, text)


def openai_forced(item):
    i, case, prompt = item
    fn = {"type": "function", "function": {"name": case["tool"], "description": case["description"], "parameters": case["schema"]}}
    choice = "required" if i % 4 == 0 else {"type": "function", "function": {"name": case["tool"]}}
    kw = dict(model=MODEL, max_tokens=256, temperature=0, tools=[fn], tool_choice=choice, messages=[{"role": "user", "content": prompt}])
    if i % 2:
        name, args, finish = "", "", None
        for chunk in oc.chat.completions.create(stream=True, **kw):
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            for tc in c.delta.tool_calls or []:
                name += tc.function.name or ""
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    else:
        r = oc.chat.completions.create(**kw)
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1, calls
        name, args, finish = calls[0].function.name, calls[0].function.arguments, r.choices[0].finish_reason
    assert finish == "tool_calls" and name == case["tool"], (finish, name)
    validate(json.loads(args), case["schema"])


def test_openai_forced_tool_calls_validate():
    # Every other prompt: 25, over all five schemas, streamed and not.
    failures = run_all(openai_forced, cases()[::2])
    assert not failures, f"{len(failures)}/25 failed: {failures}"


def openai_format(item):
    i, case, prompt = item
    rf = {"type": "json_schema", "json_schema": {"name": case["tool"], "schema": case["schema"], "strict": True}}
    r = oc.chat.completions.create(model=MODEL, max_tokens=256, temperature=0, response_format=rf,
                                   messages=[{"role": "user", "content": f"Answer in JSON. {prompt}"}])
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    validate(json.loads(r.choices[0].message.content), case["schema"])


def test_openai_response_format_validates():
    failures = run_all(openai_format, cases()[1::5])
    assert not failures, f"{len(failures)}/10 failed: {failures}"
    r = oc.chat.completions.create(model=MODEL, max_tokens=128, temperature=0, response_format={"type": "json_object"},
                                   messages=[{"role": "user", "content": "Give me a JSON object describing a dog."}])
    assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content


def test_a_schema_the_engine_cannot_enforce_is_a_400():
    bad = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}
    try:
        ac.messages.create(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "hi"}],
                           extra_body={"output_config": {"format": {"type": "json_schema", "schema": bad}}})
    except anthropic.BadRequestError as e:
        assert e.body["error"]["type"] == "invalid_request_error", e.body
    else:
        raise AssertionError("expected a 400")
    # The server keeps serving.
    ok = ac.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=[{"role": "user", "content": "hi"}])
    assert ok.stop_reason in ("end_turn", "max_tokens")


if __name__ == "__main__":
    runner.run(globals())
