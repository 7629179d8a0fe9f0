// Start the official Node.js client (pinned in package.json) with several topics: a Producer
// declaring N topics, then a SimpleConsumer subscribed to the same N, each started within a bound;
// then one message sent to and received from the last topic, so both clients work after startup.
//
//   node tests/node/many_topics.mjs <endpoint host:port> <topic prefix> <group> [topics] [startup_bound_ms]
//
// Why: the client sends its settings while it still fetches the other topics' routes and starts
// waiting for the reply only after them, so a reply that comes at once is missed and startup()
// waits for the client's own re-send, five minutes on (chronoq writes its reply again:
// chronoq/server/messaging/clients.py, SETTINGS_AGAIN_S). Prints one JSON object on stdout and
// exits 0 only when both clients started within the bound and the message went round.

import rocketmq from 'rocketmq-client-nodejs';

import { logLines, makeLogger, verbose, withTimeout } from './support.mjs';

const { Producer, SimpleConsumer } = rocketmq;

const [endpoint, prefix, group, countArg, boundArg] = process.argv.slice(2);
if (!endpoint || !prefix || !group) {
  process.stderr.write('usage: many_topics.mjs <endpoint> <topic prefix> <group> [topics] [startup_bound_ms]\n');
  process.exit(2);
}
const TOPICS = Array.from({ length: Number(countArg ?? 4) }, (_, i) => `${prefix}-${i}`);
const BOUND_MS = Number(boundArg ?? 20000);
const REQUEST_TIMEOUT_MS = 3000;
const SHUTDOWN_MS = 10000;

const result = { ok: false, topics: TOPICS.length, producer_startup_ms: null, consumer_startup_ms: null,
  received: null, error: null };

async function run(clients) {
  const producer = new Producer({ endpoints: endpoint, topics: TOPICS, requestTimeout: REQUEST_TIMEOUT_MS,
    logger: makeLogger('producer') });
  clients.push(producer);
  let t0 = Date.now();
  await withTimeout(producer.startup(), BOUND_MS, `Producer.startup with ${TOPICS.length} topics`);
  result.producer_startup_ms = Date.now() - t0;

  const consumer = new SimpleConsumer({ endpoints: endpoint, consumerGroup: group,
    subscriptions: new Map(TOPICS.map((t) => [t, '*'])), awaitDuration: 1000, requestTimeout: REQUEST_TIMEOUT_MS,
    logger: makeLogger('consumer') });
  clients.push(consumer);
  t0 = Date.now();
  await withTimeout(consumer.startup(), BOUND_MS, `SimpleConsumer.startup with ${TOPICS.length} topics`);
  result.consumer_startup_ms = Date.now() - t0;

  const last = TOPICS[TOPICS.length - 1];
  const receipt = await producer.send({ topic: last, body: Buffer.from('after startup') });
  const deadline = Date.now() + BOUND_MS;
  while (result.received === null && Date.now() < deadline) {
    for (const view of await consumer.receive(16, 30000)) {
      await consumer.ack(view);
      if (view.messageId === receipt.messageId) result.received = view.body.toString();
    }
  }
}

const clients = [];
try {
  await run(clients);
} catch (err) {
  result.error = String(err && err.stack ? err.stack : err);
} finally {
  for (const client of clients.reverse()) {
    try {
      await withTimeout(client.shutdown(), SHUTDOWN_MS, `${client.constructor.name}.shutdown`);
    } catch (err) {
      result.error = result.error ?? `shutdown failed: ${err && err.message}`;
    }
  }
  result.ok = result.error === null && result.received === 'after startup';
  if (!result.ok && !verbose) process.stderr.write(logLines.join('\n') + '\n');
  process.stdout.write(JSON.stringify(result) + '\n', () => process.exit(result.ok ? 0 : 1));
}
