// The official RocketMQ 5 Node.js client (rocketmq-client-nodejs, pinned in package.json) in the
// cluster load test (tests/integration/test_cluster.py, cluster_load.py): a Producer sending COUNT
// messages, plain, delayed and FIFO, and a SimpleConsumer of its own consumer group receiving the
// whole topic, while a broker group's primary is killed.
//
//   node tests/node/cluster_load.mjs <endpoint> <topic> <count> <fifo groups> <deadline_ms> <consumer group>
//
// Bodies say what they are: "NP-<i>" plain, "ND-<i>" delayed (due 1-4 s after its send),
// "NF<g>-<i>" the i-th message of message group "nmg-<g>". Plain and delayed sends run WINDOW at a
// time; each message group's sends run one after another (its order is the order acknowledged).
// A send that fails (the client's own 3 attempts) is sent again, as a new send, until it is
// acknowledged or the deadline passes: so a message may be stored twice when an attempt's answer
// was lost, never reordered within its group.
//
// Stdout, one JSON object a line: {"deliveries": [[body, messageId, "host:port", ms, attempt], ...]}
// for each receive (written before its acks are sent), {"sent": [{body, kind, group, seq, due_ms,
// acked, messageId, failures}, ...]} once every send is acknowledged (or the deadline passed), and
// {"done": true, ...} when stdin says "stop" (or closes) or the deadline passes; then it exits.
// "failover" on stdin makes it start a new producer (below).

import rocketmq from 'rocketmq-client-nodejs';

import { logLines, makeLogger, verbose, withTimeout } from './support.mjs';

const { Producer, SimpleConsumer } = rocketmq;

const [endpoint, topic, countArg, fifoArg, deadlineArg, consumerGroup] = process.argv.slice(2);
if (!endpoint || !topic || !countArg || !consumerGroup) {
  process.stderr.write('usage: cluster_load.mjs <endpoint> <topic> <count> <fifo groups> <deadline_ms> <group>\n');
  process.exit(2);
}
const COUNT = Number(countArg);
const FIFO_GROUPS = Number(fifoArg ?? 2);
const DEADLINE_MS = Number(deadlineArg ?? 60000);
const WINDOW = 64;               // plain and delayed sends in flight
const RESEND_PAUSE_MS = 200;     // between a failed send and the next try
const REQUEST_TIMEOUT_MS = 3000;
const AWAIT_MS = 1000;           // a receive's long poll
const RECEIVERS = 6;             // receive loops at once (one would wait out a drained queue's poll each turn)
const INVISIBLE_MS = 5000;       // acked at once; back after this if not
const started = Date.now();
const deadline = started + DEADLINE_MS;

// A quarter FIFO (spread over the message groups), a fifth delayed, the rest plain.
const messages = [];
const fifoEach = FIFO_GROUPS > 0 ? Math.floor(COUNT / 4 / FIFO_GROUPS) : 0;
for (let g = 0; g < FIFO_GROUPS; g++) {
  for (let i = 0; i < fifoEach; i++) messages.push({ body: `NF${g}-${i}`, kind: 'fifo', group: `nmg-${g}`, seq: i });
}
const delayed = Math.floor(COUNT / 5);
for (let i = 0; i < delayed; i++) messages.push({ body: `ND-${i}`, kind: 'delayed', group: '', seq: i });
for (let i = 0; messages.length < COUNT; i++) messages.push({ body: `NP-${i}`, kind: 'plain', group: '', seq: i });
for (const m of messages) Object.assign(m, { due_ms: 0, acked: false, messageId: '', failures: 0 });

// The Node producer 1.0.8 keeps the route it fetched first for sending (its route refresh never
// reaches the publishing load balancer: Producer has no onTopicRouteDataUpdate), so after a
// failover it sends a message group hashed to the dead primary there for ever. The test tells this
// script on stdin ("failover") once the route names the new primary, and it makes a new producer,
// which asks the route afresh: as an application would restart its producer. (Plain and delayed
// sends skip the dead endpoint meanwhile: the client isolates it.)
let producer = null;
let restarts = 0;

function newProducer(clients) {
  const p = new Producer({
    endpoints: endpoint, namespace: '', topics: [topic], requestTimeout: REQUEST_TIMEOUT_MS,
    logger: makeLogger('producer'),
  });
  clients.push(p);
  return withTimeout(p.startup(), deadline - Date.now(), 'Producer.startup (waits for settings)').then(() => p);
}

async function restartProducer(clients) {
  restarts++;
  producer = await newProducer(clients);
}

async function sendUntilAcked(clients, m) {
  while (Date.now() < deadline) {
    const options = { topic, body: Buffer.from(m.body) };
    if (m.kind === 'fifo') options.messageGroup = m.group;
    if (m.kind === 'delayed') {
      m.due_ms = Date.now() + 1000 + (m.seq % 4) * 1000;
      options.deliveryTimestamp = new Date(m.due_ms);
    }
    try {
      const receipt = await producer.send(options);
      Object.assign(m, { acked: true, messageId: receipt.messageId });
      return;
    } catch (err) {
      m.failures++;
      await new Promise(resolve => setTimeout(resolve, RESEND_PAUSE_MS));
    }
  }
}

let stopping = false;
const clients = [];
let restarted = Promise.resolve();
process.stdin.on('data', (chunk) => {
  if (String(chunk).includes('failover')) restarted = restartProducer(clients);
  if (String(chunk).includes('stop')) stopping = true;
});
process.stdin.on('end', () => { stopping = true; });

function emit(object) {
  return new Promise(resolve => process.stdout.write(JSON.stringify(object) + '\n', resolve));
}

async function send(clients) {
  producer = await newProducer(clients);
  const chains = [];
  for (let g = 0; g < FIFO_GROUPS; g++) {
    const mine = messages.filter(m => m.kind === 'fifo' && m.group === `nmg-${g}`);
    chains.push((async () => { for (const m of mine) await sendUntilAcked(clients, m); })());
  }
  const rest = messages.filter(m => m.kind !== 'fifo');
  let next = 0;
  const workers = Array.from({ length: WINDOW }, async () => {
    while (next < rest.length) await sendUntilAcked(clients, rest[next++]);
  });
  await Promise.all([...chains, ...workers]);
  await restarted;
  await emit({ sent: messages, elapsed_ms: Date.now() - started, producerRestarts: restarts });
}

async function receive(clients) {
  const consumer = new SimpleConsumer({
    endpoints: endpoint, namespace: '', consumerGroup, subscriptions: new Map([[topic, '*']]),
    awaitDuration: AWAIT_MS, requestTimeout: REQUEST_TIMEOUT_MS, logger: makeLogger('consumer'),
  });
  clients.push(consumer);
  await withTimeout(consumer.startup(), deadline - Date.now(), 'SimpleConsumer.startup (waits for settings)');
  let failedReceives = 0, failedAcks = 0;
  const loop = async () => {
    while (!stopping && Date.now() + AWAIT_MS + REQUEST_TIMEOUT_MS < deadline) {
      let views;
      try {
        views = await consumer.receive(32, INVISIBLE_MS);
      } catch (err) {  // a dead endpoint, until the route names its replica
        failedReceives++;
        await new Promise(resolve => setTimeout(resolve, 100));
        continue;
      }
      if (views.length === 0) continue;
      const now = Date.now();
      await emit({ deliveries: views.map(v => [v.body.toString(), v.messageId, v.endpoints.facade, now, v.deliveryAttempt]) });
      await Promise.all(views.map(v => consumer.ack(v).catch(() => { failedAcks++; })));
    }
  };
  await Promise.all(Array.from({ length: RECEIVERS }, loop));
  return { failedReceives, failedAcks };
}

let error = null;
let figures = {};
try {
  [, figures] = await Promise.all([send(clients), receive(clients)]);
} catch (err) {
  error = String(err && err.stack ? err.stack : err);
} finally {
  // The summary first: the clients' shutdown changes nothing the test checks, and one whose route
  // still names the killed node can outlast the harness's wait (seen once in CI: no summary came).
  if (error !== null && !verbose) process.stderr.write(logLines.join('\n') + '\n');
  await emit({ done: true, ok: error === null, error, elapsed_ms: Date.now() - started, producerRestarts: restarts,
               ...figures });
  await Promise.all(clients.map(client => withTimeout(client.shutdown(), 5000, `${client.constructor.name}.shutdown`)
    .catch(() => {})));  // (a shutdown that hangs on a dead endpoint: bounded, all at once)
  process.exit(error === null ? 0 : 1);
}
