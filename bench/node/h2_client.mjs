// The C-speed load client of `tokenwire bench load --client node` (driven by bench/node_client.py).
//
// Node's built-in http2 module (nghttp2 underneath, frames parsed in C) runs the same closed
// loop as bench/loadgen.py: `concurrency` streams always in flight over `connections`
// HTTP/2 connections (more when the server caps concurrent streams), each stream the same
// POST, started again as the last one ends. Times are process.hrtime.bigint() nanoseconds:
// a stream's start is taken just before its request is made, a token's time when the chunk
// that completes it is read. Tokens are counted like bench/wire.py counts them: SSE events
// (`data: [DONE]`, a finish chunk with no text and a usage chunk are not tokens), NDJSON
// lines (not the `{"finish_reason"...}` summary); the server's stage timings are taken from
// its last chunk.
//
// Usage: node h2_client.mjs CONFIG_JSON, where CONFIG_JSON has url, path, body_b64, headers
// ([[name, value]]), framing ("sse" | "ndjson"), concurrency, connections, requests, warmup.
// Protocol on stdio: after the warm-up it prints `{"warm": true}` and waits for a line `go`
// on stdin (the caller reads the server's CPU then); after the measured window it prints
// `{"done": {wall_ns, cpu_ns, num_connections}}`, then one JSON line per measured request:
// {start_ns, token_ns: [ns after start], end_ns: ns after start, status, error, timings}.
// A failure prints `{"fatal": why}` and exits 1.

import http2 from "node:http2";
import net from "node:net";
import readline from "node:readline";

const MAX_WINDOW = 2 ** 31 - 1;
const STALL_MS = 60_000;            // a level fails when no stream completes for this long

const cfg = JSON.parse(process.argv[2]);
const body = Buffer.from(cfg.body_b64, "base64");
const requestHeaders = { ":method": "POST", ":path": cfg.path, "content-length": String(body.length) };
for (const [name, value] of cfg.headers) requestHeaders[name] = value;
const countTokens = cfg.framing === "ndjson" ? countNdjson : countSse;
const sessions = [];
let nextSession = 0;
let lastCompletion = Date.now();

function fatal(why) {
  process.stdout.write(JSON.stringify({ fatal: String(why) }) + "\n", () => process.exit(1));
}

function connect() {
  return new Promise((resolve, reject) => {
    const url = new URL(cfg.url);
    const createConnection = () => net.connect({ host: url.hostname, port: Number(url.port), noDelay: true });
    const session = http2.connect(cfg.url, { createConnection, settings: { enablePush: false, initialWindowSize: MAX_WINDOW } });
    session.once("error", reject);
    session.once("remoteSettings", () => {
      session.setLocalWindowSize(MAX_WINDOW);
      session.on("error", () => {});     // streams see their own errors; a lost session fails them
      resolve(session);
    });
  });
}

async function openSessions() {
  const first = await connect();
  const cap = first.remoteSettings.maxConcurrentStreams;
  const needed = Math.max(cfg.connections, cap ? Math.ceil(cfg.concurrency / cap) : 1);
  sessions.push(first, ...(await Promise.all(Array.from({ length: needed - 1 }, connect))));
}

// -- token counters: (rec, text) -> tokens completed by this chunk (per chunk, hot path) --------
function countSse(rec, text) {
  const events = (rec.head + text).split("\n\n");
  rec.head = events.pop();
  let n = 0;
  for (const event of events) {
    if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
    if (event.includes('"finish_reason":null')) { n += 1; continue; }
    n += closingEventIsToken(rec, event.slice(6));
  }
  return n;
}

function closingEventIsToken(rec, json) {
  let chunk;
  try { chunk = JSON.parse(json); } catch { return 1; }
  if (chunk.timings && typeof chunk.timings === "object") rec.timings = chunk.timings;
  const choice = (chunk.choices || [])[0];
  if (!choice) return 0;                                  // a usage chunk
  const text = choice.text ?? (choice.delta || {}).content;
  return choice.finish_reason != null && !text ? 0 : 1;   // a finish chunk with no text
}

function countNdjson(rec, text) {
  const lines = (rec.head + text).split("\n");
  rec.head = lines.pop();
  let n = 0;
  for (const line of lines) {
    if (!line) continue;
    if (!line.startsWith('{"finish_reason"')) { n += 1; continue; }
    try { rec.timings = JSON.parse(line).timings ?? null; } catch { /* a summary we cannot read */ }
  }
  return n;
}

// -- one stream, and the closed loop ------------------------------------------------------
function startStream(done) {
  const session = sessions[nextSession];
  nextSession = (nextSession + 1) % sessions.length;
  const rec = { start: process.hrtime.bigint(), token_ns: [], end: 0n, status: 0, error: null, timings: null, head: "" };
  let req;
  try {
    req = session.request(requestHeaders);
  } catch (exc) {
    rec.error = `request failed: ${exc.message}`;
    rec.end = process.hrtime.bigint();
    return setImmediate(done, rec);
  }
  req.setEncoding("utf8");
  req.on("response", (headers) => { rec.status = headers[":status"]; });
  req.on("data", (text) => {
    const now = process.hrtime.bigint();
    for (let k = countTokens(rec, text); k > 0; k -= 1) rec.token_ns.push(now);
  });
  req.on("error", (exc) => { rec.error = rec.error || `stream error: ${exc.message}`; });
  req.on("close", () => {
    rec.end = process.hrtime.bigint();
    if (!rec.error && req.rstCode) rec.error = `stream reset (error code ${req.rstCode})`;
    if (!rec.error && rec.status !== 200) rec.error = rec.status ? `HTTP status ${rec.status}` : "stream ended without a status";
    lastCompletion = Date.now();
    done(rec);
  });
  req.end(body);
}

function closedLoop(numRequests) {
  return new Promise((resolve) => {
    const records = [];
    let issued = 0;
    const onDone = (rec) => {
      records.push(rec);
      if (issued < numRequests) issue();
      else if (records.length === numRequests) resolve(records);
    };
    const issue = () => { issued += 1; startStream(onDone); };
    if (numRequests === 0) return resolve(records);
    for (let i = 0; i < Math.min(cfg.concurrency, numRequests); i += 1) issue();
  });
}

function waitForGo() {
  return new Promise((resolve) => {
    const lines = readline.createInterface({ input: process.stdin });
    lines.once("line", () => { lines.close(); resolve(); });
  });
}

function report(rec) {
  return JSON.stringify({
    start_ns: 0, token_ns: rec.token_ns.map((t) => Number(t - rec.start)), end_ns: Number(rec.end - rec.start),
    status: rec.status, error: rec.error, timings: rec.timings,
  });
}

async function main() {
  await openSessions();
  const stall = setInterval(() => {
    if (Date.now() - lastCompletion > STALL_MS) fatal(`no stream finished for ${STALL_MS / 1000} s`);
  }, 1000);
  await closedLoop(cfg.warmup);
  process.stdout.write(JSON.stringify({ warm: true }) + "\n");
  await waitForGo();
  lastCompletion = Date.now();
  const cpuBefore = process.cpuUsage();
  const start = process.hrtime.bigint();
  const records = await closedLoop(cfg.requests);
  const wall = process.hrtime.bigint() - start;
  const cpu = process.cpuUsage(cpuBefore);
  clearInterval(stall);
  const done = { wall_ns: Number(wall), cpu_ns: (cpu.user + cpu.system) * 1000, num_connections: sessions.length };
  process.stdout.write([JSON.stringify({ done }), ...records.map(report)].join("\n") + "\n", () => {
    for (const session of sessions) session.destroy();
    process.exit(0);
  });
}

main().catch(fatal);
