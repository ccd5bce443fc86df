//! One lookup's walk down a prompt's blocks: the workers that held every block so far (alive),
//! narrowed by each block's holders; a worker dropping out is emitted with the depth it reached.
//! Alive starts as the first block's holder set: a list when few workers hold it (then each
//! step costs the list's length), a bitset when many do (then each step costs one word
//! operation per 64 slots, whatever the number of holders). A block whose holders are the
//! previous block's (the same slot or the same interned set id) changes nothing and is passed
//! without reading the set: the survivors are a subset of those holders already.

use super::holders::{bit, BitIter, Holders, View};
use super::WorkerSlot;

enum Alive {
    Empty,
    /// Sorted slots.
    List(Vec<WorkerSlot>),
    Bits(Vec<u64>),
}

pub(super) struct Walk<'o> {
    alive: Alive,
    /// The previous block's holders (None before the first block).
    last: Option<Holders>,
    out: &'o mut Vec<(WorkerSlot, usize)>,
}

impl<'o> Walk<'o> {
    pub(super) fn new(out: &'o mut Vec<(WorkerSlot, usize)>) -> Self {
        Walk { alive: Alive::Empty, last: None, out }
    }

    /// Whether `holders` are the previous block's (a step with them changes nothing).
    pub(super) fn same(&self, holders: Holders) -> bool {
        self.last == Some(holders)
    }

    /// Narrow to the holders of the next block; `depth` is the tokens matched before it.
    /// Returns false once nobody is left (the walk can stop).
    pub(super) fn step<'v>(&mut self, holders: Holders, members: impl FnOnce() -> View<'v>, depth: usize) -> bool {
        let first = self.last.is_none();
        if self.last.replace(holders) == Some(holders) {
            return true; // the common long walk: the same workers hold block after block
        }
        let holders = members();
        if first {
            self.alive = match holders {
                View::List(v) => Alive::List(v.to_vec()),
                View::Bits(b) => Alive::Bits(b.to_vec()),
            };
            return true;
        }
        let out = &mut *self.out;
        self.alive = match std::mem::replace(&mut self.alive, Alive::Empty) {
            Alive::Empty => Alive::Empty,
            Alive::List(mut list) => {
                let mut cursor = 0; // both sorted: a merge, not a search per slot
                list.retain(|&s| {
                    let kept = match holders {
                        View::List(v) => {
                            while cursor < v.len() && v[cursor] < s {
                                cursor += 1;
                            }
                            cursor < v.len() && v[cursor] == s
                        }
                        View::Bits(b) => bit(b, s),
                    };
                    if !kept {
                        out.push((s, depth));
                    }
                    kept
                });
                if list.is_empty() {
                    Alive::Empty
                } else {
                    Alive::List(list)
                }
            }
            Alive::Bits(mut words) => match holders {
                View::Bits(b) => {
                    let mut any = 0;
                    for (i, w) in words.iter_mut().enumerate() {
                        let keep = *w & b.get(i).copied().unwrap_or(0);
                        emit(out, i, *w & !keep, depth);
                        *w = keep;
                        any |= keep;
                    }
                    if any == 0 {
                        Alive::Empty
                    } else {
                        Alive::Bits(words)
                    }
                }
                // few holders: the survivors are among them, and alive becomes a list
                View::List(listed) => {
                    let kept: Vec<WorkerSlot> = listed.iter().copied().filter(|&s| bit(&words, s)).collect();
                    for &s in &kept {
                        words[s as usize / 64] &= !(1 << (s % 64));
                    }
                    for (i, w) in words.iter().enumerate() {
                        emit(out, i, *w, depth);
                    }
                    if kept.is_empty() {
                        Alive::Empty
                    } else {
                        Alive::List(kept)
                    }
                }
            },
        };
        !matches!(self.alive, Alive::Empty)
    }

    /// The walk ended (a block nobody holds, or the prompt's last full block): whoever is still
    /// alive matched `depth` tokens.
    pub(super) fn finish(self, depth: usize) {
        match self.alive {
            Alive::Empty => {}
            Alive::List(list) => self.out.extend(list.into_iter().map(|s| (s, depth))),
            Alive::Bits(words) => {
                self.out.reserve(words.iter().map(|w| w.count_ones() as usize).sum());
                for (i, w) in words.iter().enumerate() {
                    emit(self.out, i, *w, depth);
                }
            }
        }
    }
}

fn emit(out: &mut Vec<(WorkerSlot, usize)>, word: usize, bits: u64, depth: usize) {
    out.extend(BitIter(bits).map(|b| ((word * 64) as WorkerSlot + b, depth)));
}
