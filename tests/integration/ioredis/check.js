// Reads an outbox-relay stream with ioredis, as any Node.js service would, and
// checks every field the stream contract (README "The stream contract") documents.
// It uses nothing of the project's: only Redis commands and the contract.
//
//   node check.js REDIS_URL EXPECTED_JSON
//
// EXPECTED_JSON is a file written by test_ioredis.py from the outbox rows:
//   {"stream": "orders", "group": "...", "entries": [{"id": "<uuid>", "topic": "orders",
//    "key": null | "text", "payload_hex": "00ff...", "outbox_id": "12",
//    "headers": {"name": "value"}}]}
// Prints one line per problem and a summary; exits 0 when every entry matches.
"use strict";

const fs = require("fs");
const Redis = require("ioredis");

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;
const RFC3339_UTC = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$/;
const DECIMAL = /^(0|[1-9][0-9]*)$/;
const FIELDS = new Set(["id", "topic", "key", "payload", "created_at", "outbox_id"]);

async function main() {
  const [url, expectedPath] = process.argv.slice(2);
  if (!url || !expectedPath) {
    console.error("usage: node check.js REDIS_URL EXPECTED_JSON");
    return 64;
  }
  const want = JSON.parse(fs.readFileSync(expectedPath, "utf8"));
  const stream = want.stream;
  const group = want.group || "ioredis-check";
  const expected = new Map(want.entries.map((e) => [e.id, e]));
  const redis = new Redis(url, { maxRetriesPerRequest: 1, connectTimeout: 5000 });
  const problems = [];
  const seen = new Set();
  try {
    // From the start of the stream: nothing published before the group existed is missed.
    try {
      await redis.xgroup("CREATE", stream, group, "0", "MKSTREAM");
    } catch (e) {
      if (!String(e.message).startsWith("BUSYGROUP")) throw e;
    }
    let read = 0;
    for (;;) {
      // The Buffer variant: fields and values as bytes, so binary payloads survive.
      const reply = await redis.xreadgroupBuffer(
        "GROUP", group, "ioredis-1", "COUNT", 100, "BLOCK", 500, "STREAMS", stream, ">");
      if (reply === null) break;
      for (const [, entries] of reply) {
        const acks = [];
        for (const [entryId, flat] of entries) {
          read++;
          acks.push(entryId);
          checkEntry(entryId.toString(), flat, expected, seen, problems);
        }
        if (acks.length) await redis.xack(stream, group, ...acks);
      }
    }
    for (const id of expected.keys())
      if (!seen.has(id)) problems.push(`message ${id}: not read from ${stream}`);
    const pending = await redis.xpending(stream, group);
    if (Number(pending[0]) !== 0)
      problems.push(`${pending[0]} entries still pending after XACK`);
    for (const p of problems) console.log(`PROBLEM ${p}`);
    const version = require("ioredis/package.json").version;
    console.log(`ioredis ${version}: read ${read} entries of ${stream} through group ${group}` +
      ` (created at 0), acknowledged them; ${expected.size} expected,` +
      ` ${problems.length} problems`);
    return problems.length ? 1 : 0;
  } finally {
    redis.disconnect();
  }
}

function checkEntry(entryId, flat, expected, seen, problems) {
  const f = new Map();
  for (let i = 0; i + 1 < flat.length; i += 2) f.set(flat[i].toString("utf8"), flat[i + 1]);
  const text = (name) => (f.has(name) ? f.get(name).toString("utf8") : undefined);
  const where = `entry ${entryId}`;
  const id = text("id");
  if (id === undefined || !UUID.test(id)) {
    problems.push(`${where}: id ${JSON.stringify(id)} is not a UUID`);
    return;
  }
  const e = expected.get(id);
  if (e === undefined) {
    problems.push(`${where}: message ${id} was not expected`);
    return;
  }
  if (seen.has(id)) problems.push(`${where}: message ${id} read twice`);
  seen.add(id);
  const at = `${where} (message ${id})`;
  if (text("topic") !== e.topic)
    problems.push(`${at}: topic ${JSON.stringify(text("topic"))}, expected ${e.topic}`);
  if (e.key === null) {
    if (f.has("key")) problems.push(`${at}: key present (${text("key")}) for a NULL key`);
  } else if (text("key") !== e.key) {
    problems.push(`${at}: key ${JSON.stringify(text("key"))}, expected ${e.key}`);
  }
  const payload = f.get("payload");
  if (payload === undefined) problems.push(`${at}: no payload`);
  else if (!payload.equals(Buffer.from(e.payload_hex, "hex")))
    problems.push(`${at}: payload ${payload.toString("hex")}, expected ${e.payload_hex}`);
  const created = text("created_at");
  if (created === undefined || !RFC3339_UTC.test(created) || isNaN(Date.parse(created)))
    problems.push(`${at}: created_at ${JSON.stringify(created)} is not RFC 3339 UTC (Z)`);
  const outboxId = text("outbox_id");
  if (outboxId === undefined || !DECIMAL.test(outboxId) || outboxId !== e.outbox_id)
    problems.push(`${at}: outbox_id ${JSON.stringify(outboxId)}, expected ${e.outbox_id}`);
  const headers = {};
  for (const [name, value] of f) {
    if (name.startsWith("h.")) headers[name.slice(2)] = value.toString("utf8");
    else if (!FIELDS.has(name)) problems.push(`${at}: undocumented field ${name}`);
  }
  const want = e.headers || {};
  for (const name of new Set([...Object.keys(want), ...Object.keys(headers)]))
    if (headers[name] !== want[name])
      problems.push(`${at}: header h.${name} ${JSON.stringify(headers[name])},` +
        ` expected ${JSON.stringify(want[name])}`);
}

main().then(
  (code) => process.exit(code),
  (err) => {
    console.error(`check.js: ${err && err.stack ? err.stack : err}`);
    process.exit(2);
  });
