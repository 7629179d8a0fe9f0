// A body the official Node client cannot receive (within a few hundred bytes of grpc-js's 4 MiB
// limit on a received message) must not take the small messages received with it down: they
// arrive at their first attempt, and the big one is left out of this client's answers.
//
//   node tests/node/big_body.mjs <endpoint host:port> <topic> <group> [deadline_ms]
//
// Prints one JSON object: {"ok", "sent": [label...], "received": [[label, attempt, bytes]...],
// "errors": [...]}; every wait is bounded (see send_receive.mjs).

import rocketmq from 'rocketmq-client-nodejs';

import { logLines, makeLogger, verbose, withTimeout } from './support.mjs';

const { Producer, SimpleConsumer } = rocketmq;
const [endpoint, topic, group, deadlineArg] = process.argv.slice(2);
const DEADLINE_MS = Number(deadlineArg ?? 30000);
const BODIES = [['small-1', 10], ['big', 4 * 1024 * 1024 - 100], ['small-2', 10], ['small-3', 10]];
const result = { ok: false, sent: [], received: [], errors: [] };
const clients = [];
const started = Date.now();
try {
  const producer = new Producer({ endpoints: endpoint, namespace: '', topics: [topic], requestTimeout: 10000,
                                  logger: makeLogger('producer') });
  clients.push(producer);
  await withTimeout(producer.startup(), 15000, 'producer startup');
  for (const [label, size] of BODIES) {
    await producer.send({ topic, body: Buffer.alloc(size, 'a'), tag: label });
    result.sent.push(label);
  }
  const consumer = new SimpleConsumer({ endpoints: endpoint, namespace: '', consumerGroup: group,
                                        subscriptions: new Map([[topic, '*']]), awaitDuration: 1000,
                                        requestTimeout: 5000, logger: makeLogger('consumer') });
  clients.push(consumer);
  await withTimeout(consumer.startup(), 15000, 'consumer startup');
  // Until the three small ones came (or the deadline): a few receives.
  while (result.received.length < 3 && Date.now() - started < DEADLINE_MS) {
    try {
      for (const view of await consumer.receive(16, 30000)) {
        result.received.push([view.tag, view.deliveryAttempt, view.body.length]);
        await consumer.ack(view);
      }
    } catch (err) {
      result.errors.push(String(err).slice(0, 200));
      await new Promise((resolve) => setTimeout(resolve, 500));
    }
  }
  result.ok = true;
} catch (err) {
  result.errors.push(`fatal: ${String(err).slice(0, 300)}`);
}
for (const client of clients) {
  try { await withTimeout(client.shutdown(), 10000, 'shutdown'); } catch { /* bounded */ }
}
if (!result.ok || verbose) process.stderr.write(logLines.join('\n') + '\n');
console.log(JSON.stringify(result));
process.exit(0);
