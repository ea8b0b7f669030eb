//! Calls in steady state allocate nothing: real rank processes over shm, each counting the heap
//! allocations of its own calls.
//!
//! Every rank runs a sequence of rounds twice. The first pass warms up: buffers grow to the
//! sizes those rounds need. The second pass replays the same rounds (same routing, token
//! counts, modes, wire formats and receive paths) with a counting allocator armed around the
//! library's calls only (not around the test's own inputs, expert computation and checks), and
//! every allocation an armed call makes is counted against that call. A rank fails naming each
//! call that allocated and how often; every round's result is also checked against the
//! reference, so an armed call that skipped its work cannot pass.
//!
//! Scenarios: direct 2A:2E, push and pull, INT8 on the wire in some rounds, registered buffers
//! in some, and the expert-major, token-major and view receive paths in turn; and 2A:3E through
//! one relay, push, INT8 in some rounds, expert-major and token-major in turn.
//!
//! `XCCL_TEST_ALLOC_TRACE=1` prints a backtrace of each counted allocation (to find it).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use xccl::testing::harness::{first_difference, token_replies, token_reply, Workload};
use xccl::testing::reference::{expected_combine_quant, expert_output, test_expert};
use xccl::{
    Communicator, DType, ExpertBatch, MoeConfig, Quant, Role, TokenBatch, Topology, TransferMode,
};
use xccl_tests::{announce, child_main, ChildCtx, Job};

const ENTRY: &str = "child_rank_entry";

/// The system allocator, counting the allocations of a thread while it is armed.
struct CountingAlloc;

thread_local! {
    /// Whether this thread's allocations are counted (set around library calls).
    static ARMED: Cell<bool> = const { Cell::new(false) };
    /// Allocations counted on this thread since the last [`armed`] began.
    static COUNTED: Cell<usize> = const { Cell::new(0) };
}

/// Counts one allocation when this thread is armed (and, with `XCCL_TEST_ALLOC_TRACE`, prints
/// where it came from, disarmed meanwhile so the backtrace's own allocations do not count).
fn count(size: usize) {
    // `try_with`: a thread being torn down has no locals left, and allocates unarmed.
    if ARMED.try_with(Cell::get) != Ok(true) {
        return;
    }
    COUNTED.with(|c| c.set(c.get() + 1));
    if TRACE.load(Ordering::Relaxed) {
        ARMED.with(|a| a.set(false));
        let trace = std::backtrace::Backtrace::force_capture();
        eprintln!("allocation of {size} bytes in an armed call:\n{trace}");
        ARMED.with(|a| a.set(true));
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; the only additions are
// reads and writes of this thread's `Cell`s (const-initialized, no destructor, so reaching
// them never allocates) and, when tracing, a backtrace taken with counting switched off.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which `System` shares.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: `ptr` was allocated by this allocator (that is, by `System`) with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator (that is, by `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Whether counted allocations print a backtrace (`XCCL_TEST_ALLOC_TRACE`, read once before
/// anything is armed: reading the environment allocates).
static TRACE: AtomicBool = AtomicBool::new(false);

/// Allocations per library call, over the armed pass.
#[derive(Default)]
struct Tally {
    /// Whether calls are counted (the second pass).
    on: bool,
    /// Per call name: calls made armed, allocations they made.
    calls: BTreeMap<&'static str, (usize, usize)>,
}

impl Tally {
    /// Runs `f` (one library call, named `name`) armed when counting is on.
    fn call<R>(&mut self, name: &'static str, f: impl FnOnce() -> R) -> R {
        if !self.on {
            return f();
        }
        COUNTED.with(|c| c.set(0));
        ARMED.with(|a| a.set(true));
        let r = f();
        ARMED.with(|a| a.set(false));
        let n = COUNTED.with(Cell::get);
        let e = self.calls.entry(name).or_default();
        e.0 += 1;
        e.1 += n;
        r
    }

    /// `Err` naming every call that allocated, with its calls and allocations.
    fn verdict(&self, rank: usize) -> Result<String, String> {
        let summary = self
            .calls
            .iter()
            .map(|(name, (calls, allocs))| format!("{name}: {allocs} in {calls} calls"))
            .collect::<Vec<_>>()
            .join(", ");
        if self.calls.values().any(|&(_, allocs)| allocs > 0) {
            return Err(format!("rank {rank}: armed calls allocated: {summary}"));
        }
        Ok(format!(
            "rank {rank}: no allocation in armed calls ({summary})"
        ))
    }
}

#[test]
fn child_rank_entry() {
    child_main(dispatch);
}

fn dispatch(scenario: &str, ctx: &ChildCtx) -> Result<(), String> {
    match scenario {
        "direct" => steady_rounds(ctx, 2, 2, 0),
        "relayed" => steady_rounds(ctx, 2, 3, 1),
        other => Err(format!("unknown scenario {other:?}")),
    }
}

/// What one round does: the senders' mode and wire formats, the receive path, the buffers.
#[derive(Clone, Copy, Debug)]
struct RoundPlan {
    mode: TransferMode,
    a2e: Quant,
    e2a: Quant,
    /// 0: expert-major, 1: token-major, 2: view.
    path: u64,
    /// The attention ranks send from the registered input, token-major experts reply from
    /// the registered output.
    registered: bool,
}

/// Rounds of the scenario: direct rounds take every path; relayed rounds push, from the
/// caller's buffers, through the expert- and token-major receives.
fn plan_of(round: u64, relayed: bool) -> RoundPlan {
    let a2e = if round % 4 == 3 {
        Quant::Int8
    } else {
        Quant::None
    };
    let e2a = if round % 4 >= 2 {
        Quant::Int8
    } else {
        Quant::None
    };
    if relayed {
        return RoundPlan {
            mode: TransferMode::Push,
            a2e,
            e2a,
            path: round % 2,
            registered: false,
        };
    }
    RoundPlan {
        mode: if round % 3 == 1 {
            TransferMode::Pull
        } else {
            TransferMode::Push
        },
        a2e,
        e2a,
        path: round % 3,
        // Registered buffers hold dtype rows: rounds without INT8 only.
        registered: round % 4 == 1 && round % 3 != 2,
    }
}

const ROUNDS: u64 = 12;
const HIDDEN: usize = 64;
const TOPK: usize = 4;
const TOKENS: usize = 24;

/// Both passes of the scenario on this rank; the second one counted.
fn steady_rounds(ctx: &ChildCtx, m: usize, n: usize, relays: usize) -> Result<(), String> {
    TRACE.store(
        std::env::var_os("XCCL_TEST_ALLOC_TRACE").is_some(),
        Ordering::Relaxed,
    );
    let mut cfg = MoeConfig::new(HIDDEN, DType::BF16, TOPK, TOKENS);
    cfg.timeout = Duration::from_secs(30);
    let ex = ctx
        .connect(Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    let topo = Topology::contiguous(m, n, 4 * n)
        .and_then(|t| {
            if relays > 0 {
                t.with_relays(Some(relays))
            } else {
                Ok(t)
            }
        })
        .map_err(|e| e.to_string())?;
    let mut comm = Communicator::init_shm(ex, Arc::new(topo), cfg).map_err(|e| e.to_string())?;
    let wl = Workload {
        seed: 0x57ead7 + relays as u64,
        tokens: TOKENS,
        vary: true,
        skew: None,
        shared_experts: 0,
    };
    let mut state = RankState::default();
    for pass in 0..2 {
        state.tally.on = pass == 1;
        for round in 0..ROUNDS {
            let plan = plan_of(round, relays > 0);
            comm.set_mode(plan.mode);
            comm.set_a2e_quant(plan.a2e);
            comm.set_e2a_quant(plan.e2a);
            let r = match comm.role() {
                Role::Attention => state.attention(&mut comm, &wl, round, plan),
                Role::Expert => state.expert(&mut comm, plan),
            };
            r.map_err(|e| format!("pass {pass} round {round} ({plan:?}): {e}"))?;
        }
    }
    announce(&state.tally.verdict(ctx.rank)?);
    Ok(())
}

/// What a rank keeps from round to round (as an engine keeps its batches).
#[derive(Default)]
struct RankState {
    tally: Tally,
    batch: ExpertBatch,
    tokens: TokenBatch,
    out: Vec<bf16>,
}

impl RankState {
    /// One attention round: A2E send (from the caller's rows or the registered input) and E2A
    /// receive armed; the result checked against the reference.
    fn attention(
        &mut self,
        comm: &mut Communicator,
        wl: &Workload,
        round: u64,
        plan: RoundPlan,
    ) -> Result<(), String> {
        let topo = comm.topology().clone();
        let input = wl.input(&topo, TOPK, comm.rank(), round);
        let x: Vec<bf16> = wl.hidden_states(comm.rank(), round, input.num_tokens, HIDDEN);
        let want =
            expected_combine_quant(&topo, &input, &x, HIDDEN, &test_expert, plan.a2e, plan.e2a);
        let (idx, w) = (&input.topk_idx, &input.topk_weights);
        let tally = &mut self.tally;
        let handle = if plan.registered {
            let rows = tally.call("a2e_input", || comm.a2e_input::<bf16>().map(|r| r.len()));
            let rows = rows.map_err(|e| e.to_string())?;
            comm.a2e_input::<bf16>().map_err(|e| e.to_string())?[..x.len().min(rows)]
                .copy_from_slice(&x);
            tally.call("a2e_send_input", || {
                comm.a2e_send_input(input.num_tokens, idx, w)
            })
        } else {
            tally.call("a2e_send", || comm.a2e_send(&x, idx, w))
        }
        .map_err(|e| e.to_string())?;
        self.out.resize(x.len(), bf16::ZERO);
        let out = &mut self.out;
        tally
            .call("e2a_recv", || comm.e2a_recv(&handle, out))
            .map_err(|e| e.to_string())?;
        match first_difference(&self.out, &want, HIDDEN) {
            None => Ok(()),
            Some(d) => Err(format!("out{d}")),
        }
    }

    /// One expert round on the plan's receive path; receive and reply armed, the expert's
    /// computation (the reference's `test_expert`) not.
    fn expert(&mut self, comm: &mut Communicator, plan: RoundPlan) -> Result<(), String> {
        let locals = comm.topology().local_experts(comm.rank()).to_vec();
        let tally = &mut self.tally;
        match plan.path {
            0 => {
                let batch = &mut self.batch;
                tally
                    .call("a2e_recv", || comm.a2e_recv(batch))
                    .map_err(|e| e.to_string())?;
                let rows = batch.rows::<bf16>().map_err(|e| e.to_string())?;
                let mut out: Vec<bf16> = Vec::with_capacity(rows.len());
                for (j, &e) in locals.iter().enumerate() {
                    for r in batch.expert_rows(j) {
                        let row = &rows[r * HIDDEN..(r + 1) * HIDDEN];
                        out.extend(expert_output(&test_expert, e, row));
                    }
                }
                tally
                    .call("e2a_send", || comm.e2a_send(batch, &out))
                    .map_err(|e| e.to_string())
            }
            1 => {
                let tokens = &mut self.tokens;
                tally
                    .call("a2e_recv_tokens", || {
                        comm.a2e_recv_tokens(tokens, &mut |_, _| {})
                    })
                    .map_err(|e| e.to_string())?;
                let reduced: Vec<bf16> = token_replies(&locals, tokens);
                if plan.registered {
                    let output = tally.call("e2a_output", || {
                        comm.e2a_output::<bf16>(tokens).map(|o| o.len())
                    });
                    output.map_err(|e| e.to_string())?;
                    comm.e2a_output::<bf16>(tokens)
                        .map_err(|e| e.to_string())?
                        .copy_from_slice(&reduced);
                    tally
                        .call("e2a_send_output", || comm.e2a_send_output(tokens))
                        .map_err(|e| e.to_string())
                } else {
                    tally
                        .call("e2a_send_tokens", || comm.e2a_send_tokens(tokens, &reduced))
                        .map_err(|e| e.to_string())
                }
            }
            _ => {
                let view = tally.call("a2e_recv_view", || comm.a2e_recv_view());
                let mut view = view.map_err(|e| e.to_string())?;
                let mut replies: Vec<bf16> = Vec::with_capacity(view.num_tokens() * HIDDEN);
                for i in 0..view.num_tokens() {
                    let (experts, weights) = view.meta().experts_of(i);
                    let row = view.row::<bf16>(i).map_err(|e| e.to_string())?;
                    replies.extend(token_reply(&locals, experts, weights, row));
                }
                let mode = plan.mode;
                let sent = tally.call("view.e2a_send", || {
                    view.e2a_send::<bf16>(mode, |i, _, output| {
                        output.copy_from_slice(&replies[i * HIDDEN..(i + 1) * HIDDEN]);
                    })
                });
                sent.map_err(|e| e.to_string())
            }
        }
    }
}

/// Runs `scenario` and checks that every rank reported no allocation in its armed calls.
fn run(scenario: &str, size: usize) {
    let mut job = Job::spawn(ENTRY, scenario, size);
    job.expect_success(Duration::from_secs(120));
    for rank in 0..size {
        let out = job.output(rank);
        let verdict = out
            .lines()
            .find(|l| l.contains("no allocation in armed calls"));
        let Some(verdict) = verdict else {
            panic!("rank {rank}: {out}");
        };
        eprintln!("{verdict}");
    }
}

#[test]
fn direct_calls_in_steady_state_allocate_nothing_on_any_path() {
    run("direct", 4);
}

#[test]
fn relayed_calls_in_steady_state_allocate_nothing() {
    run("relayed", 5);
}
