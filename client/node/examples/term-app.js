#!/usr/bin/env node
// term-app: the smallest real terminal app over the package, as its README tells an app to
// be written: at launch it takes every session of its owner back into a custody with a
// journal (writing each replay to its "screen", then repainting, then reading it live), and
// it makes the new sessions asked for, each a shell in a new PTY deposited with a journal.
// What it shows of each session goes to DIR/<id>.<pid>.out, and what it does to DIR/events
// (JSON lines, each one write(2) on an O_APPEND fd, so a SIGKILL never leaves half a line).
//
//   term-app.js --socket PATH --owner OWNER --out DIR [--new ID]... [--timeout S]
//
// SIGTERM ends custody (every session drains in the holder) and exits 0 (1 where no holder
// confirmed it: the event close_unconfirmed); anything else
// (SIGKILL, a crash) leaves the sessions to the holder, which drains them until the next run.
'use strict';
const fs = require('node:fs');
const path = require('node:path');
const { spawn } = require('node:child_process');
const escrow = require('..');

const COUNTER = 'i=0; while :; do i=$((i+1)); echo L$i; sleep 0.02; done';

function parseArgs(argv) {
  const args = { socket: undefined, owner: undefined, out: undefined, new: [], timeout: 5 };
  for (let i = 0; i < argv.length; i += 2) {
    const [flag, value] = [argv[i], argv[i + 1]];
    if (value === undefined) throw new Error(`${flag} needs a value`);
    if (flag === '--socket') args.socket = value;
    else if (flag === '--owner') args.owner = value;
    else if (flag === '--out') args.out = value;
    else if (flag === '--new') args.new.push(value);
    else if (flag === '--timeout') args.timeout = Number(value);
    else throw new Error(`unknown option ${flag}`);
  }
  if (!args.owner || !args.out) throw new Error('usage: term-app.js --socket PATH --owner OWNER ' +
    '--out DIR [--new ID]... [--timeout S]');
  return args;
}

// A shell in a new terminal: the child a session leader (detached: setsid) whose first open
// of the slave makes it its controlling terminal, so it gets SIGHUP when the terminal hangs up.
function newTerminal(command) {
  const pty = escrow._pty.open(80, 24);
  const child = spawn('sh', ['-c', 'exec 0<>"$1" 1>&0 2>&0; eval "$2"', 'sh', pty.path, command],
    { detached: true, stdio: [pty.slave, pty.slave, pty.slave] });
  fs.closeSync(pty.slave);
  child.unref();
  child.on('error', () => {});
  return { master: pty.master, pid: child.pid };
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const events = fs.openSync(path.join(args.out, 'events'), 'a');
  const log = (event) => fs.writeSync(events, JSON.stringify(event) + '\n');
  const screens = new Map();
  const screen = (id) => {
    if (!screens.has(id)) {
      screens.set(id, fs.openSync(path.join(args.out, `${id}.${process.pid}.out`), 'a'));
    }
    return screens.get(id);
  };
  log({ event: 'started', pid: process.pid });

  const client = new escrow.EscrowClient({ owner: args.owner, socket: args.socket,
    timeout: args.timeout });
  const custody = await client.openCustody();
  custody.on('data', (id, data) => fs.writeSync(screen(id), data));
  custody.on('end', (id) => log({ event: 'ended', id }));
  custody.on('lapsed', () => log({ event: 'lapsed' }));
  custody.on('protected', () => log({ event: 'protected' }));
  // The app runs until it is told to stop, as a terminal app's window stays open with no
  // tab in it: the custody's own handles keep no process alive (a second instance that took
  // nothing would otherwise exit at once).
  const window = setInterval(() => {}, 1 << 30);
  process.on('SIGTERM', () => {
    clearInterval(window);
    // Unconfirmed (no holder said it has every session): the sessions may be held by
    // nobody, which is not a clean exit.
    custody.close().then(() => process.exit(0), (e) => {
      log({ event: 'close_unconfirmed', code: e.code });
      process.exit(1);
    });
  });

  // Launch: every session back into custody, with a journal.
  const report = await custody.reclaimAll({ journal: true, deadline: 8.0 });
  const failed = {};
  for (const [id, error] of Object.entries(report.failed)) failed[id] = error.code;
  log({ event: 'reclaimed', instance: report.holderInstance, adopted: report.adopted,
    restarts: report.restarts, unclean_restarts: report.uncleanRestarts,
    retrieved: report.retrieved.map((r) => r.id), failed });
  for (const r of report.retrieved) {
    fs.writeSync(screen(r.id), r.replay); // the replay first, as the screen showed it
    await escrow.repaint(r.fd);
    custody.startReading(r.id);
  }

  // New sessions: a shell each, deposited with a journal.
  const retrieved = new Set(report.retrieved.map((r) => r.id));
  for (const id of args.new.filter((n) => !retrieved.has(n))) {
    const term = newTerminal(process.env.TERM_APP_CMD || COUNTER);
    try {
      await custody.deposit(id, term.master, { childPid: term.pid, cols: 80, rows: 24,
        journal: true });
    } catch (e) {
      if (e.code !== 'indeterminate') throw e; // held here all the same: a resume settles it
    }
    log({ event: 'created', id, child_pid: term.pid, journal: custody.journaled(id) });
    screen(id);
    custody.startReading(id);
  }
}

main().catch((e) => {
  process.stderr.write(`term-app: ${e.code || ''} ${e.message}\n`);
  process.exit(1);
});
