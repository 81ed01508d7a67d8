#!/usr/bin/env node
// Build the addon, build/escrow.node: the C client's files (../c) and src/*.c, with the
// system C compiler against the Node-API and libuv headers installed with Node, warnings as
// errors. No node-gyp: one cc command, printed as it runs.
//
// Every file of the C client's library is built in (a missing one fails the build), and
// vector_args.c, which the codec's test entry (src/codec.c) shares with the C test driver.
'use strict';
const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');

const here = __dirname;
const c = path.join(here, '..', 'c');
// The library's files, in client/c/README.md's order, then the test-vector aid.
const library = ['escrow_errors.c', 'escrow_codec.c', 'escrow_frames.c', 'escrow_connect.c',
  'escrow_journal.c', 'escrow_resume.c', 'escrow_custody.c', 'escrow_custody_end.c', 'escrow.c',
  'escrow_retrieve_many.c', 'escrow_reclaim.c', 'escrow_repaint.c', 'vector_args.c'];

function nodeIncludes() {
  const candidates = [
    path.join(path.dirname(process.execPath), '..', 'include', 'node'),
    path.join(process.config.variables.node_prefix || '/usr', 'include', 'node'),
    '/usr/include/node',
  ];
  const found = candidates.find((dir) => fs.existsSync(path.join(dir, 'node_api.h')));
  if (found === undefined) {
    throw new Error('no node_api.h next to this Node (looked in ' + candidates.join(', ') +
      '): run scripts/setup --test, which installs the Node headers');
  }
  return found;
}

function main() {
  const sources = library.map((f) => path.join(c, f));
  const src = path.join(here, 'src');
  sources.push(...fs.readdirSync(src).filter((f) => f.endsWith('.c')).sort()
    .map((f) => path.join(src, f)));
  const out = path.join(here, 'build');
  fs.mkdirSync(out, { recursive: true });
  const args = ['-std=c11', '-Wall', '-Wextra', '-Werror', '-O2', '-g', '-fPIC', '-shared',
    '-fvisibility=hidden', '-I', c, '-I', nodeIncludes(), ...sources,
    '-o', path.join(out, 'escrow.node')];
  if (process.platform === 'darwin') args.push('-undefined', 'dynamic_lookup');
  else args.push('-lutil'); // openpty (src/pty.c)
  const cc = process.env.CC || 'cc';
  process.stderr.write([cc, ...args].join(' ') + '\n');
  execFileSync(cc, args, { stdio: 'inherit' });
}

main();
