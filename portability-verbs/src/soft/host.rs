//! Which processes this one can reach through shared memory: those with the same host
//! identity (the kernel's boot id and this PID namespace). Processes of other hosts, or of
//! another PID namespace on this one (a container, a test "host"), are reached over TCP.
//! Decided by what the provider can reach, never by a network address.

use std::hash::Hasher;
use std::os::unix::fs::MetadataExt;
use std::sync::OnceLock;

/// This process's host identity: a hash of the boot id and the PID namespace's inode, never 0.
pub fn identity() -> u64 {
    static ID: OnceLock<u64> = OnceLock::new();
    *ID.get_or_init(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let pidns = std::fs::metadata("/proc/self/ns/pid").map(|m| (m.dev(), m.ino())).unwrap_or((0, 0));
        // FNV-1a: stable across processes and builds (the identity is compared between them).
        let mut h = Fnv(0xcbf2_9ce4_8422_2325);
        h.write(boot.trim().as_bytes());
        h.write_u64(pidns.0);
        h.write_u64(pidns.1);
        h.finish() | 1
    })
}

struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ *b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_identity_is_stable_and_set() {
        assert_eq!(super::identity(), super::identity());
        assert_ne!(super::identity(), 0);
    }
}
