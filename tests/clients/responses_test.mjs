// The Responses API through the official TypeScript `openai` SDK, run as JavaScript by node.
// Run by tests/tests/responses.rs against a two-node cluster serving Qwen2.5-Coder-0.5B-Instruct
// (node a at ZEROLAYER_BASE_URL, node b at ZEROLAYER_OTHER_URL); scripts/client-node installs
// the packages and passes their directory in ZEROLAYER_CLIENTS_NODE. Exits non-zero on any
// failure.
import { createRequire } from "node:module";
import { run } from "./runner.mjs";
import { join } from "node:path";

const require = createRequire(join(process.env.ZEROLAYER_CLIENTS_NODE, "package.json"));
const OpenAI = require("openai").default;
const Ajv = require("ajv").default;

const MODEL = "qwen";
const client = (base) => new OpenAI({ baseURL: `${base}/v1`, apiKey: process.env.ALICE_KEY, maxRetries: 0, timeout: 300_000 });
const a = client(process.env.ZEROLAYER_BASE_URL);
const b = client(process.env.ZEROLAYER_OTHER_URL);
const QUESTION = "What is the capital of France? Answer in one word.";
const WEATHER = {
  type: "function",
  name: "get_weather",
  description: "Get the current weather in a city.",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"], additionalProperties: false },
  strict: false,
};

function assert(cond, what) {
  if (!cond) throw new Error(`assertion failed: ${typeof what === "string" ? what : JSON.stringify(what)}`);
}

const tests = {
  async create_and_stream_agree() {
    const plain = await a.responses.create({ model: MODEL, input: QUESTION, temperature: 0, max_output_tokens: 16 });
    assert(plain.status === "completed" && plain.output_text.includes("Paris"), plain);
    const stream = b.responses.stream({ model: MODEL, input: QUESTION, temperature: 0, max_output_tokens: 16, store: false });
    const types = [];
    const seqs = [];
    let deltas = "";
    for await (const ev of stream) {
      types.push(ev.type);
      seqs.push(ev.sequence_number);
      if (ev.type === "response.output_text.delta") deltas += ev.delta;
    }
    const final = await stream.finalResponse();
    assert(types[0] === "response.created" && types.at(-1) === "response.completed", types);
    assert(seqs.every((s, i) => s === i), seqs);
    assert(deltas === final.output_text && deltas === plain.output_text, [deltas, final.output_text, plain.output_text]);
  },
  async forced_call_validates_and_continues() {
    const first = await a.responses.create({ model: MODEL, input: "What's the weather like in Paris today?", tools: [WEATHER],
      tool_choice: { type: "function", name: "get_weather" }, temperature: 0 });
    const call = first.output.find((o) => o.type === "function_call");
    assert(call && call.name === "get_weather", first.output);
    const check = new Ajv({ strict: false }).compile(WEATHER.parameters);
    assert(check(JSON.parse(call.arguments)), call.arguments);
    const second = await b.responses.create({ model: MODEL, previous_response_id: first.id, tools: [WEATHER], tool_choice: "none", temperature: 0, max_output_tokens: 48,
      input: [{ type: "function_call_output", call_id: call.call_id, output: "18 degrees celsius and sunny" }] });
    // The output answers a call id only the first response holds (else a 400), and the answer
    // reports what it returned.
    assert(second.output_text.includes("18"), second.output_text);
  },
};

await run(tests);
