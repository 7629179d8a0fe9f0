// What the Node client scripts share: a client logger that keeps the last lines in memory (printed
// to stderr when a run fails, or always with CHRONOQ_NODE_VERBOSE=1) and a bounded wait (the
// official client waits forever for its first settings command: contract section 1.4).

import { format } from 'node:util';

export const verbose = process.env.CHRONOQ_NODE_VERBOSE === '1';
export const logLines = [];
const LOG_LINES_MAX = 2000;

export function makeLogger(name) {
  const write = (level) => (...args) => {
    const line = `${new Date().toISOString()} ${level} [${name}] ${format(...args)}`;
    if (verbose) process.stderr.write(line + '\n');
    logLines.push(line);
    if (logLines.length > LOG_LINES_MAX) logLines.shift();
  };
  return { info: write('INFO'), warn: write('WARN'), error: write('ERROR'), debug: write('DEBUG'), close() {} };
}

export function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} did not finish within ${ms} ms`)), Math.max(0, ms));
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}
