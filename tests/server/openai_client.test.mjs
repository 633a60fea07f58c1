// The official `openai` npm client against a live `clshard serve` (started by with_server.sh,
// which sets CLSHARD_URL, CLSHARD_MODEL and CLSHARD_API_KEY): the client parses every response
// (completions, chat, streaming with usage, logprobs in both endpoints' shapes, a json_schema answer
// with n choices, errors), and a stream says what the whole answer says.
import assert from 'node:assert/strict';

let OpenAI;
try {
  ({ default: OpenAI } = await import('openai'));
} catch (e) {
  console.error('openai_client: the openai package is missing from tests/server/node_modules: ' +
                'run scripts/setup.sh (npm ci in tests/server)');
  process.exit(1);
}

const baseURL = `${process.env.CLSHARD_URL}/v1`;
const model = process.env.CLSHARD_MODEL;
// No retries: a 429 or 5xx must show, not be retried away; every call has a deadline.
const client = new OpenAI({ baseURL, apiKey: process.env.CLSHARD_API_KEY, maxRetries: 0,
                            timeout: 30_000 });

const checks = [];
const check = (name, fn) => checks.push({ name, fn });

async function collect(stream, chat) {
  let text = '';
  let finish = null;
  let usage = null;
  let chunks = 0;
  let role = null;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (chat) {
        if (c.delta.role) role = c.delta.role;
        text += c.delta.content ?? '';
      } else {
        text += c.text;
      }
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  return { text, finish, usage, chunks, role };
}

check('models.list names the served model', async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.deepEqual(ids, [model]);
});

check('completions: whole and streamed agree, with usage', async () => {
  const req = { model, prompt: 'Once upon a time', max_tokens: 12, temperature: 0 };
  const whole = await client.completions.create(req);
  assert.equal(whole.object, 'text_completion');
  assert.match(whole.id, /^cmpl-[0-9a-f]{24}$/);
  assert.equal(whole.model, model);
  assert.equal(whole.choices.length, 1);
  assert.equal(typeof whole.choices[0].text, 'string');
  assert.ok(['stop', 'length'].includes(whole.choices[0].finish_reason));
  assert.ok(whole.usage.prompt_tokens > 0);
  assert.equal(whole.usage.total_tokens, whole.usage.prompt_tokens + whole.usage.completion_tokens);
  assert.ok(whole.usage.completion_tokens <= 12);

  const stream = await client.completions.create({ ...req, stream: true,
                                                   stream_options: { include_usage: true } });
  const s = await collect(stream, false);
  assert.equal(s.text, whole.choices[0].text);
  assert.equal(s.finish, whole.choices[0].finish_reason);
  assert.deepEqual(s.usage, whole.usage);
  assert.ok(s.chunks >= 2);
});

check('chat: whole and streamed agree, the template applied', async () => {
  const req = { model, messages: [{ role: 'system', content: 'You are terse.' },
                                  { role: 'user', content: 'Name a colour.' }],
                max_tokens: 10, temperature: 0 };
  const whole = await client.chat.completions.create(req);
  assert.equal(whole.object, 'chat.completion');
  assert.match(whole.id, /^chatcmpl-[0-9a-f]{24}$/);
  assert.equal(whole.choices[0].message.role, 'assistant');
  assert.equal(typeof whole.choices[0].message.content, 'string');
  // The chat template wraps the messages: more prompt tokens than the two contents alone.
  assert.ok(whole.usage.prompt_tokens > 8);

  const stream = await client.chat.completions.create({ ...req, stream: true,
                                                        stream_options: { include_usage: true } });
  const s = await collect(stream, true);
  assert.equal(s.role, 'assistant');
  assert.equal(s.text, whole.choices[0].message.content);
  assert.equal(s.finish, whole.choices[0].finish_reason);
  assert.deepEqual(s.usage, whole.usage);
});

check('a seed makes sampling repeatable', async () => {
  const req = { model, prompt: 'Random words:', max_tokens: 16, temperature: 1.0, seed: 1234 };
  const a = await client.completions.create(req);
  const b = await client.completions.create(req);
  const c = await client.completions.create({ ...req, stream: true });
  assert.equal(a.choices[0].text, b.choices[0].text);
  assert.equal((await collect(c, false)).text, a.choices[0].text);
});

check('chat logprobs: OpenAI\'s content list, also streamed', async () => {
  const req = { model, messages: [{ role: 'user', content: 'Count: one two' }], max_tokens: 8,
                temperature: 1.0, seed: 21, logprobs: true, top_logprobs: 3,
                frequency_penalty: 0.5, presence_penalty: 0.2 };
  const whole = await client.chat.completions.create(req);
  const content = whole.choices[0].logprobs.content;
  assert.equal(content.length, whole.usage.completion_tokens);
  for (const e of content) {
    assert.equal(typeof e.token, 'string');
    assert.ok(e.logprob <= 0);
    assert.ok(Array.isArray(e.bytes) && e.bytes.length > 0);
    assert.equal(e.top_logprobs.length, 3);
    for (const t of e.top_logprobs) assert.ok(t.logprob <= e.top_logprobs[0].logprob);
  }
  const stream = await client.chat.completions.create({ ...req, stream: true });
  const streamed = [];
  let text = '';
  for await (const chunk of stream)
    for (const c of chunk.choices) {
      text += c.delta.content ?? '';
      if (c.logprobs) streamed.push(...c.logprobs.content);
    }
  assert.equal(text, whole.choices[0].message.content);
  assert.deepEqual(streamed.map((e) => e.token), content.map((e) => e.token));
  streamed.forEach((e, i) => assert.ok(Math.abs(e.logprob - content[i].logprob) < 1e-5));
});

check('completions logprobs: tokens, token_logprobs, top_logprobs, text_offset', async () => {
  const req = { model, prompt: 'la la la', max_tokens: 8, temperature: 1.0, seed: 5,
                logprobs: 2, repetition_penalty: 1.2 };
  const whole = await client.completions.create(req);
  const lp = whole.choices[0].logprobs;
  const n = whole.usage.completion_tokens;
  assert.equal(lp.tokens.length, n);
  assert.equal(lp.token_logprobs.length, n);
  assert.equal(lp.top_logprobs.length, n);
  assert.equal(lp.text_offset.length, n);
  assert.equal(lp.text_offset[0], 0);
  for (const top of lp.top_logprobs) assert.ok(Object.keys(top).length <= 2);
  const stream = await client.completions.create({ ...req, stream: true });
  const tokens = [];
  for await (const chunk of stream)
    for (const c of chunk.choices) if (c.logprobs) tokens.push(...c.logprobs.tokens);
  assert.deepEqual(tokens, lp.tokens);
});

check('json_schema: the client parses the structured answer', async () => {
  const schema = { type: 'object',
                   properties: { city: { type: 'string', maxLength: 8 },
                                 population: { type: 'integer' },
                                 capital: { type: 'boolean' } },
                   required: ['city', 'population', 'capital'], additionalProperties: false };
  const whole = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'A city as JSON' }], max_tokens: 120,
    temperature: 1.0, seed: 8, n: 2,
    response_format: { type: 'json_schema', json_schema: { name: 'city', schema, strict: true } } });
  assert.equal(whole.choices.length, 2);
  for (const c of whole.choices) {
    assert.equal(c.finish_reason, 'stop');
    const v = JSON.parse(c.message.content);
    assert.deepEqual(Object.keys(v), ['city', 'population', 'capital']);
    assert.equal(typeof v.city, 'string');
    assert.ok([...v.city].length <= 8);
    assert.ok(Number.isInteger(v.population));
    assert.equal(typeof v.capital, 'boolean');
  }
  await assert.rejects(
      client.chat.completions.create({
        model, messages: [{ role: 'user', content: 'x' }],
        response_format: { type: 'json_schema',
                           json_schema: { name: 'x', schema: { type: 'string', pattern: 'a+' } } } }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'response_format' &&
             e.message.includes("response_format.json_schema.schema: unsupported keyword 'pattern'"));
});

check('errors come back as the client\'s typed errors', async () => {
  await assert.rejects(client.completions.create({ model: 'not-this-one', prompt: 'x' }),
                       (e) => e instanceof OpenAI.NotFoundError && e.status === 404 &&
                              e.code === 'model_not_found' && e.param === 'model');
  await assert.rejects(
      client.chat.completions.create({ model, messages: [{ role: 'user', content: 'x' }],
                                       temperature: -2 }),
      (e) => e instanceof OpenAI.BadRequestError && e.status === 400 &&
             e.param === 'temperature' &&
             e.message.includes('temperature: expected a number >= 0, got -2'));
  const wrongKey = new OpenAI({ baseURL, apiKey: 'sk-wrong', maxRetries: 0, timeout: 30_000 });
  await assert.rejects(wrongKey.models.list(),
                       (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
});

let failed = 0;
for (const { name, fn } of checks) {
  try {
    await fn();
    console.log(`ok   ${name}`);
  } catch (e) {
    failed++;
    console.log(`FAIL ${name}\n${e.stack ?? e}`);
  }
}
console.log(`openai client: ${checks.length - failed}/${checks.length} checks passed`);
process.exit(failed ? 1 : 0);
