// Drive the unmodified official RocketMQ 5 Node.js client (rocketmq-client-nodejs, pinned in
// package.json) against a broker: Producer sends messages with tag, keys and properties; a
// SimpleConsumer receives and acks them; one message is nacked first (changeInvisibleDuration
// with 0 ms, the way the Node client nacks) and must come back with deliveryAttempt 2.
//
//   node tests/node/send_receive.mjs <endpoint host:port> <topic> <group> [count] [deadline_ms]
//
// Prints one JSON object on stdout ({"ok": true|false, ...}) and exits 0 only when every sent
// message arrived intact and was acked. Client logs go to an in-memory buffer that is written
// to stderr when the run fails (or always with CHRONOQ_NODE_VERBOSE=1).
//
// Every wait is bounded: the Node client waits *forever* for the first settings command at
// startup (contract section 1.4), so startup, receive loop and shutdown each race a timer, and
// the script ends with process.exit so lingering gRPC handles cannot keep it alive.

import rocketmq from 'rocketmq-client-nodejs';

import { logLines, makeLogger, verbose, withTimeout } from './support.mjs';

const { Producer, SimpleConsumer } = rocketmq;

const [endpoint, topic, group, countArg, deadlineArg] = process.argv.slice(2);
if (!endpoint || !topic || !group) {
  process.stderr.write('usage: send_receive.mjs <endpoint> <topic> <group> [count] [deadline_ms]\n');
  process.exit(2);
}
const COUNT = Number(countArg ?? 5);
const DEADLINE_MS = Number(deadlineArg ?? 45000);
const AWAIT_MS = 2000;           // long poll of one receive (the RPC deadline is this + requestTimeout)
const INVISIBLE_MS = 10000;      // receive invisible time (ms: the Node API's unit)
const REQUEST_TIMEOUT_MS = 3000;
const SHUTDOWN_MS = 10000;       // per client
const TAG = 'NodeTag';
const NACKED_SEQ = 0;            // this message is nacked once, then acked on redelivery

const started = Date.now();
const deadline = started + DEADLINE_MS;

const result = {
  ok: false,
  endpoint, topic, group,
  count: COUNT,
  sent: [],        // {seq, messageId, offset}
  received: [],    // every delivery: {seq, messageId, deliveryAttempt, tag, keys, properties, body, corrupted}
  acked: [],       // message ids
  nacked: [],      // message ids
  problems: [],    // human-readable mismatches
  error: null,
  elapsed_ms: 0,
};

function bodyFor(seq) {
  return `node-body-${seq}`;
}

function check(view, expected) {
  const props = Object.fromEntries([...view.properties].sort());
  const want = {
    body: bodyFor(expected.seq),
    tag: TAG,
    keys: [`key-${expected.seq}`, 'shared-key'],
    properties: { lang: 'node', seq: String(expected.seq) },  // keys in sorted order
  };
  const problems = [];
  if (view.body.toString() !== want.body) problems.push(`body ${JSON.stringify(view.body.toString())}`);
  if (view.tag !== want.tag) problems.push(`tag ${JSON.stringify(view.tag)}`);
  if (JSON.stringify([...view.keys].sort()) !== JSON.stringify([...want.keys].sort())) {
    problems.push(`keys ${JSON.stringify(view.keys)}`);
  }
  if (JSON.stringify(props) !== JSON.stringify(want.properties)) problems.push(`properties ${JSON.stringify(props)}`);
  if (view.corrupted === true) problems.push('flagged corrupted (body digest mismatch)');
  if (view.topic !== topic) problems.push(`topic ${JSON.stringify(view.topic)}`);
  if (!view.receiptHandle) problems.push('no receipt handle');
  for (const p of problems) result.problems.push(`message ${expected.seq} (${view.messageId}): ${p}`);
}

async function run(clients) {
  const producer = new Producer({
    endpoints: endpoint, namespace: '', topics: [topic], requestTimeout: REQUEST_TIMEOUT_MS,
    logger: makeLogger('producer'),
  });
  clients.push(producer);
  await withTimeout(producer.startup(), deadline - Date.now(), 'Producer.startup (waits for settings)');
  const bySeq = new Map();
  for (let seq = 0; seq < COUNT; seq++) {
    const receipt = await producer.send({
      topic,
      body: Buffer.from(bodyFor(seq)),
      tag: TAG,
      keys: [`key-${seq}`, 'shared-key'],
      properties: new Map([['seq', String(seq)], ['lang', 'node']]),
    });
    result.sent.push({ seq, messageId: receipt.messageId, offset: Number(receipt.offset) });
    bySeq.set(receipt.messageId, { seq });
  }
  if (new Set(result.sent.map(s => s.messageId)).size !== COUNT) result.problems.push('duplicate message ids in receipts');

  const consumer = new SimpleConsumer({
    endpoints: endpoint, namespace: '', consumerGroup: group, subscriptions: new Map([[topic, '*']]),
    awaitDuration: AWAIT_MS, requestTimeout: REQUEST_TIMEOUT_MS, logger: makeLogger('consumer'),
  });
  clients.push(consumer);
  await withTimeout(consumer.startup(), deadline - Date.now(), 'SimpleConsumer.startup (waits for settings)');

  const acked = new Set();
  // Bounded by the deadline; each receive is bounded by AWAIT_MS + REQUEST_TIMEOUT_MS.
  while (acked.size < COUNT && Date.now() + AWAIT_MS + REQUEST_TIMEOUT_MS < deadline) {
    const views = await consumer.receive(16, INVISIBLE_MS);
    for (const view of views) {
      const expected = bySeq.get(view.messageId);
      result.received.push({
        seq: expected ? expected.seq : null, messageId: view.messageId, deliveryAttempt: view.deliveryAttempt,
        tag: view.tag, keys: view.keys, properties: Object.fromEntries(view.properties),
        body: view.body.toString(), corrupted: view.corrupted === true,
      });
      if (!expected) {
        result.problems.push(`unexpected message ${view.messageId}`);
        continue;
      }
      check(view, expected);
      if (acked.has(view.messageId)) {
        result.problems.push(`message ${expected.seq} delivered again after its ack (attempt ${view.deliveryAttempt})`);
        continue;
      }
      if (expected.seq === NACKED_SEQ && view.deliveryAttempt === 1) {
        // The Node client's nack: 0 ms (contract 3.3). The broker must accept it and redeliver.
        await consumer.changeInvisibleDuration(view, 0);
        result.nacked.push(view.messageId);
        continue;
      }
      const wantAttempt = expected.seq === NACKED_SEQ ? 2 : 1;
      if (view.deliveryAttempt !== wantAttempt) {
        result.problems.push(`message ${expected.seq}: deliveryAttempt ${view.deliveryAttempt}, want ${wantAttempt}`);
      }
      await consumer.ack(view);
      acked.add(view.messageId);
      result.acked.push(view.messageId);
    }
  }
  if (acked.size < COUNT) {
    const missing = result.sent.filter(s => !acked.has(s.messageId)).map(s => s.seq);
    result.problems.push(`not all messages were received and acked before the deadline: missing seqs ${missing}`);
  }
}

async function shutdownAll(clients) {
  for (const client of clients.reverse()) {
    try {
      await withTimeout(client.shutdown(), SHUTDOWN_MS, `${client.constructor.name}.shutdown`);
    } catch (err) {
      result.problems.push(`shutdown failed: ${err && err.message}`);
    }
  }
}

const clients = [];
let code = 1;
try {
  await run(clients);
} catch (err) {
  result.error = String(err && err.stack ? err.stack : err);
} finally {
  await shutdownAll(clients);
  result.elapsed_ms = Date.now() - started;
  result.ok = result.error === null && result.problems.length === 0;
  code = result.ok ? 0 : 1;
  if (!result.ok && !verbose) process.stderr.write(logLines.join('\n') + '\n');
  process.stdout.write(JSON.stringify(result) + '\n', () => process.exit(code));
}
