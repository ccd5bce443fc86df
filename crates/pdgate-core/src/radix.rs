//! An approximate radix tree of request text per worker, for cache-aware routing.
//!
//! One tree holds the prompts sent to every worker; each node lists the workers ("tenants")
//! whose prompts passed through it. It approximates the workers' prefix caches without asking
//! them: what was sent to a worker recently is probably still cached there.
//!
//! Tenants are keyed by a stable worker key (the URL), never by snapshot index, because indices
//! change whenever the snapshot is rebuilt. The tree is state the gateway owns under its own lock:
//! policies only read it ([`RadixTree::match_prefix`], O(text length)); the gateway calls
//! [`RadixTree::insert`] for the chosen worker after a decision and [`RadixTree::evict`] to stay
//! under `--max-tree-size`. Sizes are in UTF-8 bytes of edge text ("characters" for ASCII
//! prompts); edges are only ever split at character boundaries.
//!
//! Invariant: a node's tenants are a subset of its parent's (insertion touches the whole path,
//! eviction removes leaves first), so walking up from the deepest match widens the set of
//! workers that share a shorter prefix.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

/// A worker's id inside one tree (interned key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(u32);

const ROOT: u32 = 0;

#[derive(Clone, Debug, Default)]
struct Node {
    edge: String,
    parent: u32,
    /// By first character of the child's edge, sorted.
    children: Vec<(char, u32)>,
    /// Sorted tenant ids.
    tenants: Vec<u32>,
    /// Latest `now` at which any insert passed through this node.
    last_access: u64,
    live: bool,
}

#[derive(Clone, Debug)]
pub struct RadixTree {
    nodes: Vec<Node>,
    free: Vec<u32>,
    keys: Vec<Arc<str>>,
    ids: HashMap<Arc<str>, u32>,
    /// Edge bytes each tenant owns (its share of the approximate cache).
    tenant_bytes: Vec<usize>,
    /// Edge bytes in the whole tree.
    size: usize,
}

impl Default for RadixTree {
    fn default() -> Self {
        Self::new()
    }
}

/// One node on the path of a match: `matched` bytes of the text are a prefix of every
/// listed tenant's earlier text.
#[derive(Clone, Copy, Debug)]
pub struct MatchLevel<'t> {
    pub matched: usize,
    tenants: &'t [u32],
}

impl<'t> MatchLevel<'t> {
    pub fn tenant_count(&self) -> usize {
        self.tenants.len()
    }
    /// The `i`-th tenant (`i < tenant_count()`).
    pub fn tenant(&self, i: usize) -> Option<TenantId> {
        self.tenants.get(i).map(|&t| TenantId(t))
    }
    pub fn tenants(&self) -> impl Iterator<Item = TenantId> + 't {
        self.tenants.iter().map(|&t| TenantId(t))
    }
}

/// The path of a match, deepest node last.
#[derive(Clone, Debug, Default)]
pub struct PrefixMatch<'t> {
    pub levels: Vec<MatchLevel<'t>>,
}

impl PrefixMatch<'_> {
    /// Bytes matched at the deepest node (0 when nothing matched).
    pub fn matched(&self) -> usize {
        self.levels.last().map(|l| l.matched).unwrap_or(0)
    }
}

/// Length in bytes of the common prefix of `a` and `b`, at a character boundary.
fn common_prefix(a: &str, b: &str) -> usize {
    let n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    let mut n = n.min(a.len()).min(b.len());
    while !a.is_char_boundary(n) {
        n -= 1;
    }
    n
}

fn first_char(s: &str) -> char {
    s.chars().next().unwrap_or('\0')
}

impl RadixTree {
    pub fn new() -> Self {
        RadixTree { nodes: vec![Node { live: true, ..Default::default() }], free: Vec::new(), keys: Vec::new(), ids: HashMap::new(), tenant_bytes: Vec::new(), size: 0 }
    }

    /// Edge bytes stored (what `--max-tree-size` bounds).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Edge bytes owned by `key` (0 for an unknown key).
    pub fn tenant_size(&self, key: &str) -> usize {
        self.ids.get(key).map(|&t| self.tenant_bytes[t as usize]).unwrap_or(0)
    }

    /// The worker key of a tenant.
    pub fn key(&self, tenant: TenantId) -> &str {
        self.keys.get(tenant.0 as usize).map(|k| &**k).unwrap_or("")
    }

    /// Live nodes, root excluded.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len() - 1
    }

    /// Heap bytes used by the tree, estimated from capacities (for the memory report).
    pub fn memory_bytes(&self) -> usize {
        let node = std::mem::size_of::<Node>();
        let nodes: usize = self.nodes.iter().map(|n| node + n.edge.capacity() + n.children.capacity() * 8 + n.tenants.capacity() * 4).sum();
        let keys: usize = self.keys.iter().map(|k| k.len() + 16 + 16 + 8).sum();
        nodes + keys * 2 + self.free.capacity() * 4 + self.tenant_bytes.capacity() * 8
    }

    fn intern(&mut self, key: &str) -> u32 {
        if let Some(&t) = self.ids.get(key) {
            return t;
        }
        let t = self.keys.len() as u32;
        let key: Arc<str> = Arc::from(key);
        self.keys.push(key.clone());
        self.ids.insert(key, t);
        self.tenant_bytes.push(0);
        t
    }

    fn alloc(&mut self, node: Node) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn child(&self, node: u32, c: char) -> Option<u32> {
        let ch = &self.nodes[node as usize].children;
        ch.binary_search_by_key(&c, |&(k, _)| k).ok().map(|i| ch[i].1)
    }

    fn set_child(&mut self, node: u32, c: char, child: u32) {
        let ch = &mut self.nodes[node as usize].children;
        match ch.binary_search_by_key(&c, |&(k, _)| k) {
            Ok(i) => ch[i].1 = child,
            Err(i) => ch.insert(i, (c, child)),
        }
    }

    fn touch(&mut self, node: u32, tenant: u32, now: u64) {
        let n = &mut self.nodes[node as usize];
        n.last_access = n.last_access.max(now);
        if let Err(i) = n.tenants.binary_search(&tenant) {
            n.tenants.insert(i, tenant);
            self.tenant_bytes[tenant as usize] += n.edge.len();
        }
    }

    /// Records that `text` was sent to worker `key` at `now` (any monotonic unit: the tree only
    /// orders by it). O(text length).
    pub fn insert(&mut self, text: &str, key: &str, now: u64) {
        let tenant = self.intern(key);
        let mut node = ROOT;
        let mut rest = text;
        while !rest.is_empty() {
            let c = first_char(rest);
            let Some(mut child) = self.child(node, c) else {
                let leaf = Node { edge: rest.to_string(), parent: node, tenants: vec![tenant], last_access: now, live: true, ..Default::default() };
                let leaf = self.alloc(leaf);
                self.set_child(node, c, leaf);
                self.size += rest.len();
                self.tenant_bytes[tenant as usize] += rest.len();
                return;
            };
            let l = common_prefix(&self.nodes[child as usize].edge, rest);
            if l < self.nodes[child as usize].edge.len() {
                child = self.split(node, child, l);
            }
            self.touch(child, tenant, now);
            rest = &rest[l..];
            node = child;
        }
    }

    /// Splits `child`'s edge after `at` bytes; returns the new upper node.
    fn split(&mut self, parent: u32, child: u32, at: usize) -> u32 {
        let old = &self.nodes[child as usize];
        let upper = Node {
            edge: old.edge[..at].to_string(),
            parent,
            children: vec![(first_char(&old.edge[at..]), child)],
            tenants: old.tenants.clone(),
            last_access: old.last_access,
            live: true,
        };
        let first = first_char(&upper.edge);
        let upper = self.alloc(upper);
        let lower = &mut self.nodes[child as usize];
        lower.edge = lower.edge[at..].to_string();
        lower.parent = upper;
        self.set_child(parent, first, upper);
        upper
    }

    /// The path `text` follows through the tree, deepest node last. O(text length).
    pub fn match_prefix(&self, text: &str) -> PrefixMatch<'_> {
        let mut out = PrefixMatch::default();
        let (mut node, mut matched) = (ROOT, 0);
        while matched < text.len() {
            let rest = &text[matched..];
            let Some(child) = self.child(node, first_char(rest)) else { break };
            let n = &self.nodes[child as usize];
            let l = common_prefix(&n.edge, rest);
            matched += l;
            out.levels.push(MatchLevel { matched, tenants: &n.tenants });
            if l < n.edge.len() {
                break;
            }
            node = child;
        }
        out
    }

    /// The longest match and the keys of the workers that have it.
    pub fn best_match(&self, text: &str) -> (usize, Vec<&str>) {
        let m = self.match_prefix(text);
        let keys = m.levels.last().map(|l| l.tenants().map(|t| self.key(t)).collect()).unwrap_or_default();
        (m.matched(), keys)
    }

    /// Each worker's longest cached prefix of `text`, in bytes (workers with none left out).
    pub fn matched_by_key(&self, text: &str) -> Vec<(&str, usize)> {
        let mut out: Vec<(&str, usize)> = Vec::new();
        // Levels deepen along the path: a tenant's last level is its longest match.
        for level in self.match_prefix(text).levels {
            for t in level.tenants() {
                let key = self.key(t);
                match out.iter_mut().find(|(k, _)| *k == key) {
                    Some(slot) => slot.1 = level.matched,
                    None => out.push((key, level.matched)),
                }
            }
        }
        out
    }

    /// Evicts least-recently-used leaves until the tree holds at most `max_size` bytes. To keep
    /// eviction rare it goes a sixteenth below the limit once it runs. Returns bytes evicted.
    pub fn evict(&mut self, max_size: usize) -> usize {
        if self.size <= max_size {
            return 0;
        }
        let target = max_size - max_size / 16;
        let before = self.size;
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> =
            self.nodes.iter().enumerate().filter(|(i, n)| *i != ROOT as usize && n.live && n.children.is_empty()).map(|(i, n)| Reverse((n.last_access, i as u32))).collect();
        while self.size > target {
            let Some(Reverse((_, leaf))) = heap.pop() else { break };
            let parent = self.remove_leaf(leaf);
            if parent != ROOT && self.nodes[parent as usize].children.is_empty() {
                heap.push(Reverse((self.nodes[parent as usize].last_access, parent)));
            }
        }
        before - self.size
    }

    /// Unlinks a childless node; returns its parent.
    fn remove_leaf(&mut self, leaf: u32) -> u32 {
        let n = std::mem::take(&mut self.nodes[leaf as usize]);
        self.size -= n.edge.len();
        for t in &n.tenants {
            self.tenant_bytes[*t as usize] -= n.edge.len();
        }
        let siblings = &mut self.nodes[n.parent as usize].children;
        siblings.retain(|&(_, c)| c != leaf);
        self.free.push(leaf);
        n.parent
    }

    /// Forgets worker `key` entirely (it left the fleet). O(tree).
    pub fn remove_tenant(&mut self, key: &str) {
        let Some(&tenant) = self.ids.get(key) else { return };
        for n in self.nodes.iter_mut().filter(|n| n.live) {
            if let Ok(i) = n.tenants.binary_search(&tenant) {
                n.tenants.remove(i);
            }
        }
        self.tenant_bytes[tenant as usize] = 0;
        // Nodes nobody owns any more: by the subset invariant their subtrees are empty too.
        let mut stack: Vec<u32> = self.nodes[ROOT as usize].children.iter().map(|&(_, c)| c).collect();
        let mut orphans = Vec::new();
        while let Some(i) = stack.pop() {
            let n = &self.nodes[i as usize];
            if n.tenants.is_empty() {
                orphans.push(i);
            } else {
                stack.extend(n.children.iter().map(|&(_, c)| c));
            }
        }
        for top in orphans {
            self.remove_subtree(top);
        }
    }

    fn remove_subtree(&mut self, top: u32) {
        let mut stack = vec![top];
        let mut order = Vec::new();
        while let Some(i) = stack.pop() {
            order.push(i);
            stack.extend(self.nodes[i as usize].children.iter().map(|&(_, c)| c));
        }
        for i in order.into_iter().rev() {
            self.remove_leaf(i);
        }
    }

    /// Checks the structural invariants; for tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut size = 0;
        let mut owned = vec![0usize; self.keys.len()];
        for (i, n) in self.nodes.iter().enumerate().filter(|(_, n)| n.live) {
            if i != ROOT as usize {
                if n.edge.is_empty() {
                    return Err(format!("node {i} has an empty edge"));
                }
                let p = &self.nodes[n.parent as usize];
                if n.parent != ROOT && !n.tenants.iter().all(|t| p.tenants.binary_search(t).is_ok()) {
                    return Err(format!("node {i} has tenants its parent lacks"));
                }
                if !p.children.contains(&(first_char(&n.edge), i as u32)) {
                    return Err(format!("node {i} is not linked from its parent"));
                }
                size += n.edge.len();
                for &t in &n.tenants {
                    owned[t as usize] += n.edge.len();
                }
            }
            if !n.children.windows(2).all(|w| w[0].0 < w[1].0) || !n.tenants.windows(2).all(|w| w[0] < w[1]) {
                return Err(format!("node {i} lists are not sorted"));
            }
        }
        if size != self.size {
            return Err(format!("size {} but edges sum to {size}", self.size));
        }
        if owned != self.tenant_bytes {
            return Err("tenant byte counts drifted".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_match() {
        let mut t = RadixTree::new();
        t.insert("hello world", "a", 1);
        t.insert("hello there", "b", 2);
        t.check_invariants().unwrap();
        assert_eq!(t.best_match("hello world!"), (11, vec!["a"]));
        assert_eq!(t.best_match("hello you"), (6, vec!["a", "b"]));
        assert_eq!(t.best_match("bye"), (0, vec![]));
        assert_eq!(t.size(), "hello ".len() + "world".len() + "there".len());
        assert_eq!(t.tenant_size("a"), 11);
        let mut by = t.matched_by_key("hello world!");
        by.sort();
        assert_eq!(by, vec![("a", 11), ("b", 6)], "each worker's longest prefix");
        assert!(t.matched_by_key("bye").is_empty());
    }

    #[test]
    fn multibyte_edges_split_on_char_boundaries() {
        let mut t = RadixTree::new();
        t.insert("héllo", "a", 1);
        t.insert("hèllo", "b", 1);
        t.check_invariants().unwrap();
        assert_eq!(t.best_match("hèl"), ("hèl".len(), vec!["b"]));
        assert_eq!(t.best_match("hx"), (1, vec!["a", "b"]));
    }

    #[test]
    fn eviction_drops_least_recent_first() {
        let mut t = RadixTree::new();
        t.insert("aaaaaaaaaa", "a", 1);
        t.insert("bbbbbbbbbb", "b", 2);
        t.insert("cccccccccc", "c", 3);
        assert_eq!(t.evict(30), 0);
        // Eviction goes a sixteenth below the limit: 24 → at most 23 bytes.
        assert_eq!(t.evict(24), 10);
        assert_eq!(t.size(), 20);
        t.check_invariants().unwrap();
        assert_eq!(t.best_match("aaaa").0, 0);
        assert_eq!(t.best_match("cccc").0, 4);
    }

    #[test]
    fn removing_a_tenant_frees_what_only_it_owned() {
        let mut t = RadixTree::new();
        t.insert("shared prefix one", "a", 1);
        t.insert("shared prefix two", "b", 1);
        t.remove_tenant("a");
        t.check_invariants().unwrap();
        assert_eq!(t.best_match("shared prefix one"), ("shared prefix ".len(), vec!["b"]));
        assert_eq!(t.size(), "shared prefix two".len());
    }
}
