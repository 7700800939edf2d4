//! What a round does, decided before it runs: a list of steps, each one
//! operation of one task or one fault, drawn from an RNG seeded by
//! (seed, round) alone. The same list replays the same round; a shorter
//! list (the shrinker's) replays a round with less in it.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::faults::FaultKind;

/// One step of a round: `task` runs `action` (for a fault, `task` is the
/// task it hits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    pub(crate) task: usize,
    pub(crate) action: Action,
}

/// Every operation a scenario's task can run, and the faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub(crate) enum Action {
    /// guard: the decision's read of the entity's OPEN incidents.
    Read,
    /// guard: open an incident if the read saw none (the guarded write).
    Write,
    /// guard: a person resolves the entity's OPEN incidents.
    Close,
    /// sequence: BEGIN a READ COMMITTED declaration.
    Begin,
    /// sequence: take the scope's next number and insert the row.
    Number,
    /// sequence: COMMIT the declaration.
    Commit,
    /// sequence: ROLLBACK the declaration.
    Rollback,
    /// jobs: enqueue job `job`; the round's set-up, before its schedule
    /// (the checker holds every job enqueued to account).
    Enqueue { job: usize },
    /// jobs: claim job `job` (two-phase, with a lease).
    Claim { job: usize },
    /// jobs: record the side effect and complete, fenced by the lease.
    Complete { job: usize },
    /// idempotency: acquire key `key`.
    Acquire { key: usize },
    /// idempotency: write the side effect and the response, commit.
    Finish { key: usize },
    /// queue: send message `seq` of group `group`.
    Send { group: usize, seq: usize },
    /// queue: receive one message.
    Receive,
    /// queue: delete the current delivery by its receipt.
    Ack,
    /// events: the round's append strategy (index into
    /// `AppendStrategy::ALL`), the schedule's first step.
    UseStrategy { strategy: u8 },
    /// events: the decision read of the round's claims.
    Decide,
    /// events: append a claim on the decision's condition.
    Append,
    /// events: append with no condition, a claim or (`other_tag`) an event
    /// under another tag.
    AppendPlain { other_tag: bool },
    /// events: a claim through `append_in`, in a transaction begun at
    /// isolation `isolation` (0 READ COMMITTED, 1 REPEATABLE READ, 2
    /// SERIALIZABLE).
    AppendIn { isolation: u8 },
    /// pipeline: one incident run of `observations` observations; with the
    /// webhook receiver failing and answering late; a restart (when the
    /// schedule has one) `restart_after_ms` into the run.
    Pipeline {
        observations: u16,
        webhook_faults: bool,
        restart_after_ms: u32,
        /// A child `pgonce worker` joins the run and is SIGKILLed this
        /// long after it started.
        #[serde(default)]
        worker_kill_after_ms: Option<u32>,
    },
    /// A fault; `target` names the job, key or group it aims at where the
    /// fault needs one.
    Fault { fault: FaultKind, target: usize },
}

impl Action {
    pub(crate) fn is_fault(&self) -> bool {
        matches!(self, Action::Fault { .. })
    }
}

/// The RNG of round `round` of a run seeded `seed`: a round is
/// reproducible from the pair alone, whatever ran before it.
pub(crate) fn round_rng(seed: u64, round: u64) -> StdRng {
    // splitmix64 of the pair, so neighbouring rounds get unrelated streams.
    let mut z = seed ^ round.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    StdRng::seed_from_u64(z ^ (z >> 31))
}

/// Merges per-task programs into one schedule, keeping each task's order:
/// a random interleaving.
pub(crate) fn interleave(rng: &mut StdRng, programs: Vec<Vec<Action>>) -> Vec<Step> {
    let mut cursors = vec![0usize; programs.len()];
    let total: usize = programs.iter().map(Vec::len).sum();
    let mut steps = Vec::with_capacity(total);
    while steps.len() < total {
        let ready: Vec<usize> = (0..programs.len())
            .filter(|&t| cursors[t] < programs[t].len())
            .collect();
        let task = ready[rng.random_range(0..ready.len())];
        steps.push(Step {
            task,
            action: programs[task][cursors[task]],
        });
        cursors[task] += 1;
    }
    steps
}

/// The schedule of a scenario where each of `tasks` tasks takes one of
/// `keys` keys and then releases it, once or twice (`take_and_release`
/// gives the two actions for a key: a claim and its completion, say),
/// interleaved at random, with up to three faults among the steps, a hold
/// that runs out (`FaultKind::Expiry`) among them.
pub(crate) fn takes_then_releases(
    rng: &mut StdRng,
    faults: &[FaultKind],
    tasks: usize,
    keys: usize,
    take_and_release: impl Fn(usize) -> [Action; 2],
) -> Vec<Step> {
    let programs = (0..tasks)
        .map(|_| {
            let mut program = Vec::new();
            for _ in 0..rng.random_range(1..=2) {
                let key = rng.random_range(0..keys);
                program.extend(take_and_release(key));
            }
            program
        })
        .collect();
    let mut steps = interleave(rng, programs);
    sprinkle_faults(
        rng,
        &mut steps,
        faults,
        &[FaultKind::Expiry],
        tasks,
        keys,
        3,
    );
    steps
}

/// Inserts up to `max` faults at random points, each aimed at a random
/// task and target, drawn from those of the run's `faults` that every
/// scenario takes ([`FaultKind::GENERIC`]) or that are in the scenario's
/// `extra`. A restart is rarer than the rest: it costs seconds.
pub(crate) fn sprinkle_faults(
    rng: &mut StdRng,
    steps: &mut Vec<Step>,
    faults: &[FaultKind],
    extra: &[FaultKind],
    tasks: usize,
    targets: usize,
    max: usize,
) {
    let kinds: Vec<FaultKind> = faults
        .iter()
        .copied()
        .filter(|f| FaultKind::GENERIC.contains(f) || extra.contains(f))
        .collect();
    if kinds.is_empty() {
        return;
    }
    let count = rng.random_range(0..=max);
    for _ in 0..count {
        let fault = kinds[rng.random_range(0..kinds.len())];
        if fault == FaultKind::Restart && !rng.random_bool(0.25) {
            continue;
        }
        let at = rng.random_range(0..=steps.len());
        steps.insert(
            at,
            Step {
                task: rng.random_range(0..tasks),
                action: Action::Fault {
                    fault,
                    target: rng.random_range(0..targets.max(1)),
                },
            },
        );
    }
}

/// Delta debugging over a failing schedule: removes ever smaller chunks
/// while `still_fails` says the shorter schedule still shows the violation,
/// trying at most `budget` replays. Returns the shortest schedule found.
pub(crate) async fn shrink<F>(steps: Vec<Step>, budget: usize, mut still_fails: F) -> Vec<Step>
where
    F: AsyncFnMut(&[Step]) -> bool,
{
    let mut current = steps;
    let mut parts = 2usize;
    let mut tries = 0usize;
    while current.len() >= 2 && tries < budget {
        let chunk = current.len().div_ceil(parts);
        let mut reduced = false;
        for i in 0..parts {
            let start = i * chunk;
            if start >= current.len() || tries >= budget {
                break;
            }
            let end = (start + chunk).min(current.len());
            let candidate: Vec<Step> = current[..start]
                .iter()
                .chain(&current[end..])
                .copied()
                .collect();
            if candidate.is_empty() {
                continue;
            }
            tries += 1;
            if still_fails(&candidate).await {
                current = candidate;
                reduced = true;
                break;
            }
        }
        if reduced {
            parts = (parts - 1).max(2);
            continue;
        }
        if parts >= current.len() {
            break;
        }
        parts = (parts * 2).min(current.len());
    }
    current
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_is_reproducible_from_seed_and_round() {
        let a: Vec<u32> = (0..4).map(|_| round_rng(7, 3).random()).collect();
        let b: Vec<u32> = (0..4).map(|_| round_rng(7, 3).random()).collect();
        assert_eq!(a, b);
        assert_ne!(
            round_rng(7, 3).random::<u64>(),
            round_rng(7, 4).random::<u64>()
        );
    }

    #[test]
    fn interleaving_keeps_each_tasks_order() {
        let mut rng = round_rng(1, 1);
        let steps = interleave(
            &mut rng,
            vec![
                vec![Action::Read, Action::Write],
                vec![Action::Begin, Action::Number, Action::Commit],
            ],
        );
        let of = |t: usize| -> Vec<Action> {
            steps
                .iter()
                .filter(|s| s.task == t)
                .map(|s| s.action)
                .collect()
        };
        assert_eq!(of(0), vec![Action::Read, Action::Write]);
        assert_eq!(of(1), vec![Action::Begin, Action::Number, Action::Commit]);
    }

    #[tokio::test]
    async fn shrinking_keeps_only_what_the_failure_needs() {
        let steps: Vec<Step> = (0..20)
            .map(|i| Step {
                task: i,
                action: Action::Read,
            })
            .collect();
        // Fails while tasks 3 and 11 are both present.
        let shrunk = shrink(steps, 100, async |s: &[Step]| {
            s.iter().any(|x| x.task == 3) && s.iter().any(|x| x.task == 11)
        })
        .await;
        let tasks: Vec<usize> = shrunk.iter().map(|s| s.task).collect();
        assert_eq!(tasks, vec![3, 11]);
    }
}
