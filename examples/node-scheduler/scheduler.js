#!/usr/bin/env node
// A minimal scheduler in Node.js that drives kvcache.v1.KVManagerService.
//
// It loads the .proto at run time (no generated code), admits a prompt,
// admits a second request with the same prompt through a nested Step op (a
// prefix-cache hit), decodes both through the columnar DecodeBatch, keeps
// its own copy of the block tables from the responses only, checks it
// against GetBlockTables, frees everything and shows one error path.
//
// Usage: node scheduler.js HOST:PORT[,HOST:PORT...]   (or KV_MANAGERS=HOST:PORT,...)
// Several addresses are the members of a high-availability group: calls
// follow its primary. Progress goes to stderr; stdout gets one JSON summary
// line. Exit code 0 on success, 1 on any failure.
'use strict';

const assert = require('node:assert/strict');
const path = require('node:path');
const { promisify } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'proto');
const PROTO_FILE = 'kvcache/v1/kv_manager.proto';
const DEADLINE_MS = 10_000;
const MAX_FAILOVERS = 50; // tries of one call refused NOT_PRIMARY, 100 ms apart when no primary is named

const PROMPT = Array.from({ length: 40 }, (_, i) => 1000 + i);
const NUM_DECODE_STEPS = 20;
const OK = 'ALLOCATE_STATUS_OK';

const log = (...args) => console.error('[scheduler]', ...args);

// A client whose unary methods return promises, each call with a deadline.
// It follows the primary of a group: a standby refuses a mutation with
// UNAVAILABLE and the trailers `kvcache-reason: NOT_PRIMARY` and, when it
// knows one, `kvcache-primary: HOST:PORT`. Nothing was applied, so the call
// is sent again there, or to the next address.
function connect(addresses) {
  const definition = protoLoader.loadSync(PROTO_FILE, {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto: request_id, not requestId
    longs: String, // uint64 (step ids, incarnation) can exceed 2^53
    enums: String, // 'ALLOCATE_STATUS_OK'
    defaults: true, // unset scalars and repeated fields come back as 0 / '' / []
  });
  const { KVManagerService } = grpc.loadPackageDefinition(definition).kvcache.v1;
  const known = [...addresses];
  const clients = new Map(); // one channel per address, opened at its first call
  const clientAt = (address) => {
    if (!clients.has(address)) clients.set(address, new KVManagerService(address, grpc.credentials.createInsecure()));
    return clients.get(address);
  };
  let current = known[0];
  const rpc = { address: () => current, close: () => clients.forEach((client) => client.close()) };
  for (const name of Object.keys(KVManagerService.service)) {
    if (KVManagerService.service[name].responseStream) continue; // Watch* streams are not used here
    rpc[name] = async (request = {}) => {
      for (let attempt = 1; ; attempt++) {
        const client = clientAt(current);
        try {
          return await promisify(client[name]).call(client, request, { deadline: Date.now() + DEADLINE_MS });
        } catch (err) {
          const reason = err.metadata?.get('kvcache-reason')[0];
          if (err.code !== grpc.status.UNAVAILABLE || reason !== 'NOT_PRIMARY' || attempt === MAX_FAILOVERS) throw err;
          const primary = err.metadata.get('kvcache-primary')[0];
          if (primary && !known.includes(primary)) known.push(primary);
          current = primary || known[(known.indexOf(current) + 1) % known.length];
          log(`${name}: not the primary; trying ${current}`);
          if (!primary) await new Promise((resolve) => setTimeout(resolve, 100));
        }
      }
    };
  }
  return rpc;
}

// The scheduler's own view: request id -> { computed, groups: Map(group_id -> block ids) }.
class BlockTables {
  constructor() {
    this.requests = new Map();
  }

  // A first allocate: the table starts as the adopted hit (num_computed_tokens
  // tokens of it), then the change applies.
  admit(requestId, response) {
    const entry = { computed: response.num_computed_tokens, groups: new Map() };
    this.requests.set(requestId, entry);
    for (const group of response.groups) {
      entry.groups.set(group.group_id, [...group.hit_block_ids]);
    }
    this.allocated(requestId, response);
  }

  // Any OK allocate (AllocateResponse or a nested StepResult.allocate).
  allocated(requestId, response) {
    const entry = this.requests.get(requestId);
    assert.equal(response.num_computed_tokens, entry.computed, `${requestId}: num_computed_tokens`);
    entry.computed += response.num_scheduled_tokens;
    for (const group of response.groups) {
      this.change(requestId, group.group_id, group.new_block_index, group.new_block_ids);
    }
  }

  // The group's table from newBlockIndex on is replaced by newBlockIds.
  change(requestId, groupId, newBlockIndex, newBlockIds) {
    const groups = this.requests.get(requestId).groups;
    const table = groups.get(groupId) ?? [];
    assert.ok(newBlockIndex <= table.length, `${requestId} group ${groupId}: new_block_index past the end`);
    groups.set(groupId, [...table.slice(0, newBlockIndex), ...newBlockIds]);
  }

  toJSON() {
    return Object.fromEntries(
      [...this.requests].map(([id, { computed, groups }]) => [
        id,
        { num_computed_tokens: computed, block_ids: Object.fromEntries(groups) },
      ]),
    );
  }
}

// Every accepted mutation takes the next step id.
function nextStep(state, stepId) {
  assert.equal(BigInt(stepId), state.lastStepId + 1n, 'step ids are consecutive');
  state.lastStepId = BigInt(stepId);
}

async function run(addresses) {
  const kv = connect(addresses);
  const tables = new BlockTables();
  try {
    const config = await kv.GetConfig();
    const blockSize = config.groups[0].block_size;
    log(`replica ${config.replica_id} (incarnation ${config.incarnation}): ${config.num_blocks} blocks,`,
      config.groups.map((g) => `${g.kind}/${g.block_size}`).join(', '));

    const stats0 = await kv.GetStats();
    const state = { lastStepId: BigInt(stats0.last_step_id) };
    const [a, b] = [`node-a-${process.pid}`, `node-b-${process.pid}`];

    // 1. Admit request A: the whole prompt in one prefill.
    const first = await kv.Allocate({ request_id: a, token_ids: PROMPT, num_new_tokens: PROMPT.length });
    assert.equal(first.status, OK, `Allocate ${a}`);
    nextStep(state, first.step_id);
    tables.admit(a, first);
    log(`admitted ${a}: ${first.num_scheduled_tokens} tokens, blocks`, tables.requests.get(a).groups.get(0));

    // 2. Steps: the first admits B through a nested allocate op (A's full
    //    prompt blocks are cached by now: a prefix hit), and every step decodes
    //    the running requests as columns, one token each.
    let running = [a];
    let prefixHitBlocks = 0;
    for (let i = 0; i < NUM_DECODE_STEPS; i++) {
      const ops = i === 0 ? [{ allocate: { request_id: b, token_ids: PROMPT, num_new_tokens: PROMPT.length } }] : [];
      const decode = { request_ids: running, token_ids: running.map((_, j) => 5000 + 100 * j + i) };
      const step = await kv.Step({ ops, decode });
      nextStep(state, step.step_id);

      if (ops.length) {
        assert.equal(step.results.length, 1, 'one result per op');
        const admittedB = step.results[0].allocate;
        assert.equal(admittedB.status, OK, `Step allocate ${b}`);
        tables.admit(b, admittedB);
        prefixHitBlocks = admittedB.groups[0].hit_block_ids.length;
        assert.deepEqual(admittedB.groups[0].hit_block_ids, tables.requests.get(a).groups.get(0).slice(0, prefixHitBlocks));
        log(`admitted ${b} in step ${step.step_id}: hit ${admittedB.num_computed_tokens} tokens in`,
          `${prefixHitBlocks} blocks shared with ${a}`);
      }

      const { statuses, num_computed_tokens: computed, changes } = step.decode;
      running.forEach((id, j) => {
        assert.equal(statuses[j], OK, `decode ${id} in step ${step.step_id}`);
        const entry = tables.requests.get(id);
        assert.equal(computed[j], entry.computed, `${id}: num_computed_tokens`);
        entry.computed += 1;
      });
      for (const ch of changes) {
        tables.change(running[ch.op_index], ch.group_id, ch.new_block_index, ch.new_block_ids);
        log(`step ${step.step_id}: ${running[ch.op_index]} group ${ch.group_id} from ${ch.new_block_index}:`,
          ch.new_block_ids);
      }
      if (ops.length) running = [a, b];
    }

    // 3. Our tables must equal the manager's.
    const server = await kv.GetBlockTables({ request_ids: [a, b] });
    assert.equal(BigInt(server.step_id), state.lastStepId, 'GetBlockTables reflects our last step');
    for (const row of server.tables) {
      const mine = tables.requests.get(row.request_id);
      assert.equal(row.num_computed_tokens, mine.computed, `${row.request_id}: num_computed_tokens`);
      assert.deepEqual(
        new Map(row.groups.map((g) => [g.group_id, g.block_ids])),
        mine.groups,
        `${row.request_id}: block table`,
      );
      if (config.groups[0].kind === 'GROUP_KIND_FULL_ATTENTION') {
        const blocks = Math.ceil(mine.computed / blockSize);
        assert.equal(mine.groups.get(0).length, blocks, `${row.request_id}: ${blocks} blocks hold ${mine.computed} tokens`);
      }
    }
    assert.equal(server.tables.length, 2);
    const summaryTables = tables.toJSON();

    // 4. Free both; the pool is empty again.
    const freed = await kv.Free({ request_ids: [a, b] });
    tables.requests.clear();
    nextStep(state, freed.step_id);
    const stats = await kv.GetStats();
    assert.equal(stats.num_requests, 0, 'GetStats.num_requests after Free');
    assert.equal(stats.num_free_blocks, config.num_blocks - 1, 'every block but the null block is free');
    assert.equal(BigInt(stats.last_step_id), state.lastStepId, 'GetStats.last_step_id');

    // 5. An error path: freeing an unknown request is NOT_FOUND, with the
    //    reason as trailing metadata.
    let notFound;
    try {
      await kv.Free({ request_ids: ['no-such-request'] });
      assert.fail('Free of an unknown request succeeded');
    } catch (err) {
      if (err.code !== grpc.status.NOT_FOUND) throw err;
      notFound = { code: err.code, reason: err.metadata.get('kvcache-reason')[0] ?? null, details: err.details };
      log(`Free(no-such-request): ${grpc.status[err.code]} (${err.code}), kvcache-reason=${notFound.reason}: ${err.details}`);
    }
    assert.ok(notFound.reason, 'the kvcache-reason trailer is set');

    return {
      ok: true,
      address: kv.address(),
      replica_id: config.replica_id,
      incarnation: config.incarnation,
      block_size: blockSize,
      steps: NUM_DECODE_STEPS,
      last_step_id: state.lastStepId.toString(),
      prefix_hit_blocks: prefixHitBlocks,
      requests: summaryTables,
      block_ids: summaryTables[a].block_ids[0],
      num_freed_blocks: freed.num_freed_blocks,
      stats_after_free: { num_requests: stats.num_requests, num_free_blocks: stats.num_free_blocks },
      not_found: notFound,
    };
  } finally {
    // On a failure, release what we still hold so a rerun starts clean.
    const held = [...tables.requests.keys()];
    if (held.length) await kv.Free({ request_ids: held }).catch(() => {});
    kv.close();
  }
}

async function main() {
  const addresses = (process.argv[2] ?? process.env.KV_MANAGERS ?? '').split(',').map((a) => a.trim()).filter(Boolean);
  if (!addresses.length) {
    console.error('usage: node scheduler.js HOST:PORT[,HOST:PORT...]  (or KV_MANAGERS=HOST:PORT,...)');
    process.exitCode = 2;
    return;
  }
  try {
    console.log(JSON.stringify(await run(addresses)));
  } catch (err) {
    console.error('[scheduler] FAILED:', err);
    console.log(JSON.stringify({ ok: false, error: String(err.message ?? err), code: err.code ?? null }));
    process.exitCode = 1;
  }
}

main();
