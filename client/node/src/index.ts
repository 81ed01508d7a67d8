/**
 * escrow-client for Node: an app's terminals kept alive by escrowd while the app restarts.
 *
 * A thin layer over the C client (client/c/), built in as a Node-API addon
 * (build/escrow.node, src/addon.c): every call that talks to the holder is a promise, run
 * off the main thread; a Custody runs its calls one at a time, watches for the holder going
 * away ('lapsed', then 'protected' once a new holder has every session again), and reads its
 * sessions for the app ('data', 'end') so that what the app reads is in the session's
 * journal. The fds it hands out (a retrieve's, a reclaim's) are the app's, as numbers.
 * Errors are Errors with `code` (the C client's escrow_code name), `id` and `errno`.
 */
import { EventEmitter } from 'node:events';
import * as path from 'node:path';

/** The name of an error: the holder's (PROTOCOL.md 9) or the client's own. */
export type EscrowCode =
  | 'bad_request' | 'unsupported_version' | 'forbidden' | 'unknown' | 'exists'
  | 'not_a_terminal' | 'custody_held' | 'busy' | 'drain_stop_timeout' | 'limit'
  | 'handed_off' | 'released' | 'expired' | 'ack_late'
  | 'unavailable' | 'unresponsive' | 'config' | 'protocol' | 'system'
  /** A custody's deposit got no answer to believe: kept, settled by the next resume. */
  | 'indeterminate'
  | (string & {}); // a code newer than this client

export interface EscrowError extends Error {
  code: EscrowCode;
  /** The session the error is about, or null. */
  id: string | null;
  /** The errno behind it, or 0. */
  errno: number;
  /** unsupported_version: the versions the holder speaks. */
  versions?: number[];
  /** A reclaim that failed part way: what it took all the same (their fds are the app's). */
  report?: ReclaimReport;
  /** 'indeterminate': what the C client said of the deposit (unresponsive, protocol...). */
  cause?: EscrowError;
}

export function isEscrowError(e: unknown): e is EscrowError {
  return e instanceof Error && typeof (e as { code?: unknown }).code === 'string';
}

export interface Session {
  owner: string;
  id: string;
  label: string;
  /** An open set: treat a state you do not know as such. */
  state: 'held' | 'draining' | 'handing_off' | 'handed_off' | 'exited' | 'released' |
    'expired' | (string & {});
  childPid: number | null;
  /** null: cannot tell. */
  childAlive: boolean | null;
  depositedAt: number;
  stateSince: number;
  bufferedBytes: number;
  droppedBytes: number;
  custodianPid: number | null;
  handoffId: string | null;
  cols: number;
  rows: number;
  meta: Record<string, string>;
  replayGapAt: number | null;
  replayGaps: number[];
}

export interface Status {
  pid: number;
  version: string;
  startedAt: number;
  socket: string;
  sessionsByState: Record<string, number>;
  counters: Record<string, number>;
  limits: Record<string, number>;
  openFds: number | null;
  rssBytes: number | null;
  instance: string | null;
  fdStore: string | null;
  keeperPid: number | null;
  adopted: number;
  adoptedWithoutRecord: number;
  adoptedRenamed: number;
  /** null: unknown (the holder lost the count), never "no restart". */
  restarts: number | null;
  uncleanRestarts: number | null;
}

export interface Welcome {
  version: number;
  holderVersion: string;
  pid: number;
  drainStopBudget: number;
  sendDeadline: number;
  ackDeadline: number;
  limits: Record<string, number>;
  features: string[];
}

export interface Retrieved {
  id: string;
  /** The PTY master: the app's (close-on-exec). */
  fd: number;
  /** Write it to the screen before anything read from fd. */
  replay: Buffer;
  droppedBytes: number;
  replayTrimmed: number;
  replayJournaled: number;
  /** The replay begins with this many bytes that set restoredModes: write it to a reset terminal. */
  replayPreamble: number;
  restoredModes: string[];
  handoffId: string | null;
  /** false: the holder could not confirm; the fd is the app's all the same. */
  confirmed: boolean;
  /** Retrieved into custody with a journal: what the custody reads is recorded. */
  journal: boolean;
  /** As it was before the retrieve. */
  session: Session;
}

export interface ReclaimReport {
  retrieved: Retrieved[];
  failed: Record<string, EscrowError>;
  holderInstance: string | null;
  adopted: number;
  /** An empty report after restarts (or null: unknown) means the escrow was lost. */
  restarts: number | null;
  uncleanRestarts: number | null;
}

export interface DepositOptions {
  label?: string;
  childPid?: number;
  cols?: number;
  rows?: number;
  meta?: Record<string, string>;
  /** Ask for a journal (PROTOCOL.md 10.6): read the session with startReading. */
  journal?: boolean;
}

export interface UpdateOptions {
  cols?: number;
  rows?: number;
  /** Replaces the whole map; undefined leaves it. */
  meta?: Record<string, string>;
}

export interface ClientOptions {
  owner: string;
  /** Default: $ESCROW_SOCKET, else $XDG_RUNTIME_DIR/escrowd/escrowd.sock, else /tmp/escrowd-<uid>/. */
  socket?: string;
  /** Seconds per call (default 5: longer than the holder's 3 s drain-stop budget). */
  timeout?: number;
}

interface Settings {
  owner: string;
  socket: string;
  timeout: number;
}

type Emit = (event: string, ...args: unknown[]) => void;

interface Native {
  client(settings: ClientOptions): Settings;
  call(kind: number, settings: Settings | number, ...args: unknown[]): Promise<unknown>;
  custodyOpen(settings: Settings, emit: Emit): Promise<object>;
  custodyCall(handle: object, kind: number, ...args: unknown[]): Promise<unknown>;
  custodySync(handle: object, what: string, id?: string, bytes?: Uint8Array): unknown;
  encode(type: string, args: string[]): string;
  openpty(cols: number, rows: number): { master: number; slave: number; path: string };
}

// eslint-disable-next-line @typescript-eslint/no-require-imports
const native = require(path.join(__dirname, '..', 'build', 'escrow.node')) as Native;

// The addon's calls, in src/addon.h's order (escrow__node_kind).
const enum Op {
  Status, Welcome, List, Release, Update, HandOff, Retrieve, Reclaim, Repaint,
  CustodyOpen, Deposit, CustodyRelease, CustodyUpdate, CustodyRetrieve, CustodyReclaim,
  CustodyClose,
}

export class EscrowClient {
  readonly owner: string;
  readonly socket: string;
  readonly timeout: number;
  private readonly settings: Settings;

  /** Throws an EscrowError ('config') for a bad owner or a socket path over 103 bytes. */
  constructor(options: ClientOptions) {
    this.settings = native.client(options);
    ({ owner: this.owner, socket: this.socket, timeout: this.timeout } = this.settings);
  }

  status(): Promise<Status> {
    return native.call(Op.Status, this.settings) as Promise<Status>;
  }

  welcome(): Promise<Welcome> {
    return native.call(Op.Welcome, this.settings) as Promise<Welcome>;
  }

  list(options: { allOwners?: boolean } = {}): Promise<Session[]> {
    return native.call(Op.List, this.settings, options.allOwners ?? false) as Promise<Session[]>;
  }

  async release(id: string): Promise<void> {
    await native.call(Op.Release, this.settings, id);
  }

  async update(id: string, options: UpdateOptions): Promise<void> {
    await native.call(Op.Update, this.settings, id, options.cols, options.rows, options.meta);
  }

  /** Deposit and end custody at once: the app must not read fd again, and should close it. */
  async handOff(id: string, fd: number, options: DepositOptions = {}): Promise<void> {
    await native.call(Op.HandOff, this.settings, id, fd, options);
  }

  /** Take a session back out of escrow: the fd is the app's alone. */
  retrieve(id: string): Promise<Retrieved> {
    return native.call(Op.Retrieve, this.settings, id) as Promise<Retrieved>;
  }

  /** Every session of the owner, out of escrow, under one deadline (seconds, default 8). */
  reclaimAll(options: { deadline?: number } = {}): Promise<ReclaimReport> {
    return native.call(Op.Reclaim, this.settings, options.deadline) as Promise<ReclaimReport>;
  }

  /** A custodian connection: sessions deposited or retrieved into it stay escrowed. */
  async openCustody(): Promise<Custody> {
    const custody = new Custody();
    const handle = await native.custodyOpen(this.settings, custody.emitFromNative);
    custody.attach(handle);
    return custody;
  }
}

/** Make the full-screen program on a retrieved terminal draw its screen again (PROTOCOL.md
 * 12.5). Call it after writing the replay, before reading. */
export async function repaint(fd: number): Promise<void> {
  await native.call(Op.Repaint, fd);
}

export interface CustodyEvents {
  /** The holder went away: the sessions are not escrowed until 'protected'. */
  lapsed: [error: EscrowError];
  /** A holder has every session held here again. */
  protected: [];
  /** Bytes read from a session's master (and recorded in its journal). */
  data: [id: string, data: Buffer];
  /** No more 'data': the terminal hung up (errno 5, EIO), or cannot be read for the app's
   * own doing (9, EBADF: it closed its master while held), or end of file (0). */
  end: [id: string, errno: number];
}

/**
 * A custody (PROTOCOL.md 10.2): what it holds stays `held` by this app, which reads it; when
 * the app dies, or closes the custody, every session is draining in the holder. Its calls run
 * one at a time in the order made.
 */
export class Custody extends EventEmitter {
  private handle: object | null = null;
  private closing: Promise<void> | null = null;

  /** @internal */
  readonly emitFromNative: Emit = (event, ...args) => {
    this.emit(event, ...args);
  };

  /** @internal */
  attach(handle: object): void {
    this.handle = handle;
  }

  private get h(): object {
    if (this.handle === null) throw new Error('the custody is not open');
    return this.handle;
  }

  override on<K extends keyof CustodyEvents>(event: K,
    listener: (...args: CustodyEvents[K]) => void): this {
    return super.on(event, listener as (...args: unknown[]) => void);
  }

  override once<K extends keyof CustodyEvents>(event: K,
    listener: (...args: CustodyEvents[K]) => void): this {
    return super.once(event, listener as (...args: unknown[]) => void);
  }

  /** The holder gets its own copy of fd; the app keeps it and reads it with startReading.
   * Rejects with 'indeterminate' where no answer could be believed: the session is held here
   * all the same (fd(id), startReading), `protected` is false until a resume settles it, and
   * release gives it up. Any other rejection: nothing is held. */
  async deposit(id: string, fd: number, options: DepositOptions = {}): Promise<void> {
    await native.custodyCall(this.h, Op.Deposit, id, fd, options);
  }

  /** The user closed the session: the holder drops its copy. */
  async release(id: string): Promise<void> {
    await native.custodyCall(this.h, Op.CustodyRelease, id);
  }

  /** The window size or meta changed (set the size on the terminal first). */
  async update(id: string, options: UpdateOptions): Promise<void> {
    await native.custodyCall(this.h, Op.CustodyUpdate, id, options.cols, options.rows,
      options.meta);
  }

  /** Take a session back and keep it escrowed, held here (`retrieve{keep}`). */
  retrieve(id: string, options: { journal?: boolean } = {}): Promise<Retrieved> {
    return native.custodyCall(this.h, Op.CustodyRetrieve, id,
      options.journal ?? false) as Promise<Retrieved>;
  }

  /** Every session of the owner back into this custody, under one deadline (seconds, 8). */
  reclaimAll(options: { journal?: boolean; deadline?: number } = {}): Promise<ReclaimReport> {
    return native.custodyCall(this.h, Op.CustodyReclaim, options.journal ?? false,
      options.deadline) as Promise<ReclaimReport>;
  }

  /** Emit 'data' for the session's output from now on (the master becomes non-blocking):
   * the app reads through the custody, never the fd itself. */
  startReading(id: string): void {
    native.custodySync(this.h, 'startReading', id);
  }

  /** Record bytes the app read from the session's master itself (its PTY library reads it:
   * then startReading fails, errno 17, EEXIST), each chunk as it came, in order, so that the
   * next replay has them. Made while a custody call runs, it is queued and recorded once
   * that call is done, never dropped or reordered. A crash between the library's read and
   * this call loses that read unmarked (startReading's reads do not). Nothing happens for a
   * session without a journal; throws 'unknown' for one not held here, 'config' once
   * closed. */
  record(id: string, bytes: Uint8Array): void {
    native.custodySync(this.h, 'record', id, bytes);
  }

  stopReading(id: string): void {
    native.custodySync(this.h, 'stopReading', id);
  }

  /** Whether what is read of the session goes into its replay (a journal is mapped). */
  journaled(id: string): boolean {
    return native.custodySync(this.h, 'journaled', id) as boolean;
  }

  /** The master the custody holds for id (the app's fd), or -1. */
  fd(id: string): number {
    return native.custodySync(this.h, 'fd', id) as number;
  }

  /** true: every session held here is escrowed right now. */
  get protected(): boolean {
    return this.handle !== null && native.custodySync(this.handle, 'protected') as boolean;
  }

  /** End custody: every session held here is draining once it resolves; read none again.
   * Rejects ('unavailable': "custody ended unconfirmed") where custody had lapsed and no
   * holder confirmed within the timeout that it has each session: closed all the same, but
   * those sessions may be held by nobody (tell the user; a reclaim at the next launch finds
   * what the holder has). A second call gives the first one's promise. */
  close(): Promise<void> {
    if (this.closing === null) this.closing = this.end();
    return this.closing;
  }

  private async end(): Promise<void> {
    if (this.handle === null) return;
    try {
      await native.custodyCall(this.handle, Op.CustodyClose);
    } catch (e) {
      if (!(isEscrowError(e) && e.code === 'config')) throw e; // closed already
    }
  }
}

/** @internal The C codec, for the test of this package against protocol-vectors/. */
export const _codec = {
  /** The arguments of escrow-c's `encode` command; the request frame in hex. */
  encode(type: string, args: string[]): string {
    return native.encode(type, args);
  },
};

/** @internal A new terminal, echo off (openpty), for an app without a PTY library: the
 * example app. Both fds are the caller's. */
export const _pty = {
  open(cols = 80, rows = 24): { master: number; slave: number; path: string } {
    return native.openpty(cols, rows);
  },
};
