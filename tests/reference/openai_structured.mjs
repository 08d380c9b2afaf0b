// Structured outputs and forced tool choices through the official `openai` npm client against a
// pdserve endpoint, each non-streaming and streaming, and prints
// {"version", "schema_text", "schema_stream_text", "schema_finish", "named": {"name", "arguments"},
//  "named_stream": {...}, "named_finish", "required": [{"name", "arguments"}], "required_stream": [...],
//  "required_finish"}.
// usage: node openai_structured.mjs NODE_MODULES_DIR BASE_URL MODEL MAX_TOKENS
import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';

const [modulesDir, baseURL, model, maxTokens] = process.argv.slice(2);
const require = createRequire(path.join(path.resolve(modulesDir), 'noop.js'));
const OpenAI = require('openai').default ?? require('openai');
const version = JSON.parse(fs.readFileSync(path.join(modulesDir, 'openai', 'package.json'), 'utf-8')).version;
const client = new OpenAI({ baseURL, apiKey: 'test-key', timeout: 60000, maxRetries: 0 });

const messages = [{ role: 'user', content: 'w?' }];
const base = { model, messages, max_tokens: Number(maxTokens), temperature: 0 };
const schema = {
  type: 'object',
  properties: { city: { type: 'string', maxLength: 8 }, temp: { type: 'integer', minimum: -40, maximum: 50 } },
  required: ['city', 'temp'], additionalProperties: false,
};
const tools = [
  { type: 'function', function: { name: 'get_weather', parameters: {
    type: 'object', properties: { c: { type: 'string', maxLength: 6 } }, required: ['c'], additionalProperties: false } } },
  { type: 'function', function: { name: 'add', parameters: {
    type: 'object', properties: { a: { type: 'integer', minimum: 0, maximum: 99 } }, required: ['a'],
    additionalProperties: false } } },
];

// the text (or the tool calls, gathered from their deltas) of a streamed request, and its finish
async function streamed(req) {
  const stream = await client.chat.completions.create({ ...req, stream: true });
  let text = '';
  let finish = null;
  const calls = [];
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      if (c.delta.content) text += c.delta.content;
      for (const t of c.delta.tool_calls ?? []) {
        calls[t.index] ??= { name: '', arguments: '' };
        if (t.function?.name) calls[t.index].name = t.function.name;
        if (t.function?.arguments) calls[t.index].arguments += t.function.arguments;
      }
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  return { text, finish, calls };
}

const callsOf = (m) => (m.tool_calls ?? []).map((t) => ({ name: t.function.name, arguments: t.function.arguments }));

const rs = { ...base, response_format: { type: 'json_schema', json_schema: { name: 'weather', schema, strict: true } } };
const s1 = await client.chat.completions.create(rs);
const s2 = await streamed(rs);
const rn = { ...base, tools, tool_choice: { type: 'function', function: { name: 'get_weather' } } };
const n1 = await client.chat.completions.create(rn);
const n2 = await streamed(rn);
const rr = { ...base, tools, tool_choice: 'required' };
const r1 = await client.chat.completions.create(rr);
const r2 = await streamed(rr);
process.stdout.write(JSON.stringify({
  version,
  schema_text: s1.choices[0].message.content, schema_finish: s1.choices[0].finish_reason,
  schema_stream_text: s2.text, schema_stream_finish: s2.finish,
  named: callsOf(n1.choices[0].message), named_finish: n1.choices[0].finish_reason,
  named_stream: n2.calls, named_stream_finish: n2.finish,
  required: callsOf(r1.choices[0].message), required_finish: r1.choices[0].finish_reason,
  required_stream: r2.calls, required_stream_finish: r2.finish,
}));
