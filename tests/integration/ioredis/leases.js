// An ordered consumer's steps, called from ioredis as a Node.js consumer would:
// the partition-lease functions of docs/CONSUMERS.md ("Ordered consumers"),
// with nothing of the project's but that contract.
//
//   node leases.js REDIS_URL STREAM GROUP
//
// The stream must exist with the group at id 0 and at least four entries.
// Two consumers, "node-a" and "node-b": A takes the lease and reads two
// entries; its lease runs out; B takes it, and A can no longer read,
// acknowledge, take over or dead-letter; B takes A's entries over, reads the
// rest, acknowledges some and dead-letters one; B releases the lease.
// Prints one line per problem and a summary; exits 0 when all held.
"use strict";

const Redis = require("ioredis");

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function main() {
  const [url, stream, group] = process.argv.slice(2);
  if (!url || !stream || !group) {
    console.error("usage: node leases.js REDIS_URL STREAM GROUP");
    return 64;
  }
  const lease = `{${stream}}:lease:${group}`;
  const tokens = `{${stream}}:lease-token:${group}`;
  const dlq = `{${stream}}.${group}.dlq`;
  const redis = new Redis(url, { maxRetriesPerRequest: 1, connectTimeout: 5000 });
  const problems = [];
  let checks = 0;
  const check = (ok, what) => {
    checks++;
    if (!ok) problems.push(what);
  };
  const fcall = (name, keys, ...args) => redis.call("FCALL", name, keys.length, ...keys, ...args);
  const leaseLost = async (what, name, keys, ...args) => {
    try {
      await fcall(name, keys, ...args);
      check(false, `${what}: answered, where LEASELOST was expected`);
    } catch (e) {
      check(String(e.message).startsWith("LEASELOST"), `${what}: ${e.message}`);
    }
  };
  const ids = (reply) => (reply ? reply[0][1].map((e) => e[0]) : []);
  try {
    const all = (await redis.xrange(stream, "-", "+")).map((e) => e[0]);
    check(all.length >= 4, `the stream has ${all.length} entries, 4 needed`);

    const [tokenA, holderA, ttlA] = await fcall("outbox_consumer_lease_v1", [lease, tokens],
      "node-a", 300, 0);
    check(tokenA >= 1 && holderA === "node-a" && ttlA === 300,
      `A's lease: ${JSON.stringify([tokenA, holderA, ttlA])}`);
    const refused = await fcall("outbox_consumer_lease_v1", [lease, tokens], "node-b", 5000, 0);
    check(refused[0] === 0 && refused[1] === "node-a" && refused[2] > 0 && refused[2] <= 300,
      `B while A holds it: ${JSON.stringify(refused)}`);
    const renewed = await fcall("outbox_consumer_lease_v1", [lease, tokens], "node-a", 300,
      tokenA);
    check(renewed[0] === tokenA, `A's renewal: ${JSON.stringify(renewed)}`);

    const readA = ids(await fcall("outbox_consumer_read_v1", [stream, lease], group, "node-a",
      tokenA, 2, ">"));
    check(JSON.stringify(readA) === JSON.stringify(all.slice(0, 2)),
      `A read ${JSON.stringify(readA)}`);

    await sleep(400);
    const [tokenB, holderB] = await fcall("outbox_consumer_lease_v1", [lease, tokens], "node-b",
      5000, 0);
    check(tokenB > tokenA && holderB === "node-b", `B's lease: token ${tokenB} after ${tokenA}`);

    await leaseLost("A reads after losing its lease", "outbox_consumer_read_v1", [stream, lease],
      group, "node-a", tokenA, 10, ">");
    await leaseLost("A acknowledges after losing its lease", "outbox_consumer_ack_v1",
      [stream, lease], group, tokenA, all[0]);
    await leaseLost("A takes over after losing its lease", "outbox_consumer_take_v1",
      [stream, lease], group, "node-a", tokenA, 10);
    await leaseLost("A dead-letters after losing its lease",
      "outbox_consumer_dead_letter_leased_v1", [dlq, stream, lease], group, tokenA, all[1],
      "dlq.reason", "permanent");
    const pending = await redis.xpending(stream, group);
    check(pending[0] === 2, `pending after A's refused calls: ${pending[0]}, expected 2`);

    const [asked, taken] = await fcall("outbox_consumer_take_v1", [stream, lease], group,
      "node-b", tokenB, 100);
    check(JSON.stringify(asked) === JSON.stringify(all.slice(0, 2)) &&
      JSON.stringify(taken.map((e) => e[0])) === JSON.stringify(all.slice(0, 2)),
    `B took over ${JSON.stringify(asked)}`);
    const readB = ids(await fcall("outbox_consumer_read_v1", [stream, lease], group, "node-b",
      tokenB, 100, ">"));
    check(JSON.stringify(readB) === JSON.stringify(all.slice(2)), `B read ${JSON.stringify(readB)}`);

    const acked = await fcall("outbox_consumer_ack_v1", [stream, lease], group, tokenB,
      ...all.slice(0, all.length - 1));
    check(acked === all.length - 1, `B acknowledged ${acked} of ${all.length - 1}`);
    const dead = await fcall("outbox_consumer_dead_letter_leased_v1", [dlq, stream, lease], group,
      tokenB, all[all.length - 1], "dlq.reason", "exhausted");
    const letters = (await redis.xrange(dlq, "-", "+")).map((e) => e[0]);
    check(letters.length === 1 && letters[0] === dead, `dead letters ${JSON.stringify(letters)}`);
    check((await redis.xpending(stream, group))[0] === 0, "entries left pending");

    check(await fcall("outbox_consumer_release_v1", [lease], tokenA) === 0,
      "A's old token released the lease");
    check(await fcall("outbox_consumer_release_v1", [lease], tokenB) === 1,
      "B's token did not release the lease");
    check(await redis.exists(lease) === 0, "the lease is still there after its release");
  } finally {
    redis.disconnect();
  }
  for (const p of problems) console.log(`problem: ${p}`);
  const version = require("ioredis/package.json").version;
  console.log(`ioredis ${version}: lease contract, ${checks} checks, ${problems.length} problems`);
  return problems.length === 0 ? 0 : 1;
}

main().then(
  (code) => process.exit(code),
  (err) => {
    console.error(`leases.js: ${err && err.stack ? err.stack : err}`);
    process.exit(2);
  });
