// Constrained decoding through the official TypeScript SDKs (`@anthropic-ai/sdk`, `openai`),
// run as JavaScript by node. Run by tests/tests/constrained.rs against a node serving
// Qwen2.5-Coder-0.5B-Instruct; scripts/client-node installs the packages and passes their
// directory in ZEROLAYER_CLIENTS_NODE. The cases are constrained_cases.json's: every forced tool
// input must validate against its schema (50 of 50, half streamed), and so must structured
// output. Exits non-zero on any failure.
import { createRequire } from "node:module";
import { run } from "./runner.mjs";
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const require = createRequire(join(process.env.ZEROLAYER_CLIENTS_NODE, "package.json"));
const Anthropic = require("@anthropic-ai/sdk").default;
const OpenAI = require("openai").default;
const Ajv = require("ajv").default;

const BASE = process.env.ZEROLAYER_BASE_URL;
const MODEL = process.env.ZEROLAYER_MODEL ?? "qwen";
const here = dirname(fileURLToPath(import.meta.url));
const CASES = JSON.parse(readFileSync(join(here, "constrained_cases.json"), "utf8")).schemas;
const PARALLEL = 4;

const ac = new Anthropic({ baseURL: BASE, apiKey: "test-key", maxRetries: 0, timeout: 300_000 });
const oc = new OpenAI({ baseURL: `${BASE}/v1`, apiKey: "test-key", maxRetries: 0, timeout: 300_000 });
const ajv = new Ajv({ strict: false });

function cases() {
  const out = [];
  for (const c of CASES) for (const p of c.prompts) out.push({ i: out.length, c, p });
  return out;
}

function validate(instance, schema) {
  const check = ajv.compile(schema);
  if (!check(instance)) throw new Error(`invalid: ${JSON.stringify(instance)}: ${ajv.errorsText(check.errors)}`);
}

function assert(cond, what) {
  if (!cond) throw new Error(`assertion failed: ${typeof what === "string" ? what : JSON.stringify(what)}`);
}

// Runs f over items PARALLEL at a time; returns the failures.
async function runAll(f, items) {
  const failures = [];
  let next = 0;
  const lane = async () => {
    while (next < items.length) {
      const item = items[next++];
      try {
        await f(item);
      } catch (e) {
        failures.push([item.i, item.p, String(e)]);
      }
    }
  };
  await Promise.all(Array.from({ length: PARALLEL }, lane));
  return failures;
}

async function forcedTool({ i, c, p }) {
  const params = {
    model: MODEL, max_tokens: 256, temperature: 0,
    tools: [{ name: c.tool, description: c.description, input_schema: c.schema }],
    tool_choice: { type: "tool", name: c.tool },
    messages: [{ role: "user", content: p }],
  };
  const msg = i % 2 ? await ac.messages.stream(params).finalMessage() : await ac.messages.create(params);
  const calls = msg.content.filter((b) => b.type === "tool_use");
  assert(msg.stop_reason === "tool_use", msg);
  assert(calls.length === 1 && calls[0].name === c.tool && calls[0].id.startsWith("toolu_"), msg.content);
  validate(calls[0].input, c.schema);
}

async function structured({ i, c, p }) {
  const params = {
    model: MODEL, max_tokens: 256, temperature: 0,
    output_config: { format: { type: "json_schema", schema: c.schema } },
    messages: [{ role: "user", content: `Answer in JSON. ${p}` }],
  };
  const msg = i % 2 ? await ac.messages.stream(params).finalMessage() : await ac.messages.create(params);
  assert(msg.stop_reason === "end_turn", msg);
  validate(JSON.parse(msg.content.filter((b) => b.type === "text").map((b) => b.text).join("")), c.schema);
}

async function openaiForced({ i, c, p }) {
  const params = {
    model: MODEL, max_tokens: 256, temperature: 0,
    tools: [{ type: "function", function: { name: c.tool, description: c.description, parameters: c.schema } }],
    tool_choice: { type: "function", function: { name: c.tool } },
    messages: [{ role: "user", content: p }],
  };
  let name = "", args = "", finish = null;
  if (i % 2) {
    for await (const chunk of await oc.chat.completions.create({ ...params, stream: true })) {
      const ch = chunk.choices?.[0];
      if (!ch) continue;
      for (const tc of ch.delta.tool_calls ?? []) {
        name += tc.function?.name ?? "";
        args += tc.function?.arguments ?? "";
      }
      finish = ch.finish_reason ?? finish;
    }
  } else {
    const r = await oc.chat.completions.create(params);
    const calls = r.choices[0].message.tool_calls;
    assert(calls.length === 1, calls);
    [name, args, finish] = [calls[0].function.name, calls[0].function.arguments, r.choices[0].finish_reason];
  }
  assert(finish === "tool_calls" && name === c.tool, [finish, name]);
  validate(JSON.parse(args), c.schema);
}

const tests = {
  async anthropic_forced_tool_inputs_validate_50_of_50() {
    const f = await runAll(forcedTool, cases());
    assert(f.length === 0, `${f.length}/50 failed: ${JSON.stringify(f)}`);
  },
  async anthropic_structured_output_validates() {
    const f = await runAll(structured, cases().filter((x) => x.i % 5 === 2));
    assert(f.length === 0, `${f.length}/10 failed: ${JSON.stringify(f)}`);
  },
  async openai_forced_tool_calls_validate() {
    const f = await runAll(openaiForced, cases().filter((x) => x.i % 5 === 3));
    assert(f.length === 0, `${f.length}/10 failed: ${JSON.stringify(f)}`);
  },
};

await run(tests);
