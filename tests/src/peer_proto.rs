//! The little command protocol between the cross-process tests and `pv_peer`.

/// Bytes of each of the peer's two regions.
pub const REGION: usize = 1 << 20;
/// Bytes of one command or reply slot.
pub const CTRL_SLOT: usize = 64 * 1024;

/// Where the peer's regions are (sent as connection private data).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub user_addr: u64,
    pub user_rkey: u32,
    pub seg_addr: u64,
    pub seg_rkey: u32,
}

impl Layout {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&self.user_addr.to_le_bytes());
        v.extend_from_slice(&self.user_rkey.to_le_bytes());
        v.extend_from_slice(&self.seg_addr.to_le_bytes());
        v.extend_from_slice(&self.seg_rkey.to_le_bytes());
        v
    }
    pub fn decode(b: &[u8]) -> Option<Layout> {
        if b.len() != 24 {
            return None;
        }
        Some(Layout {
            user_addr: u64::from_le_bytes(b[0..8].try_into().ok()?),
            user_rkey: u32::from_le_bytes(b[8..12].try_into().ok()?),
            seg_addr: u64::from_le_bytes(b[12..20].try_into().ok()?),
            seg_rkey: u32::from_le_bytes(b[20..24].try_into().ok()?),
        })
    }
}

/// A request to the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Send these bytes back.
    Echo(Vec<u8>),
    /// Answer the FNV-1a hash of a range of a region.
    Checksum { segment: bool, offset: u64, len: u64 },
    /// Protect (no access) whole pages of the user region.
    Protect { offset: u64, len: u64 },
    /// Lift the protection.
    Unprotect,
    /// Answer the u64 at an offset of a region.
    Read64 { segment: bool, offset: u64 },
    /// Stop serving.
    Exit,
}

impl Command {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        match self {
            Command::Echo(d) => {
                v.push(1);
                v.extend_from_slice(d);
            }
            Command::Checksum { segment, offset, len } => {
                v.push(2);
                v.push(*segment as u8);
                v.extend_from_slice(&offset.to_le_bytes());
                v.extend_from_slice(&len.to_le_bytes());
            }
            Command::Protect { offset, len } => {
                v.push(3);
                v.extend_from_slice(&offset.to_le_bytes());
                v.extend_from_slice(&len.to_le_bytes());
            }
            Command::Unprotect => v.push(4),
            Command::Read64 { segment, offset } => {
                v.push(5);
                v.push(*segment as u8);
                v.extend_from_slice(&offset.to_le_bytes());
            }
            Command::Exit => v.push(6),
        }
        v
    }
    pub fn decode(b: &[u8]) -> Option<Command> {
        let u64_at = |i: usize| b.get(i..i + 8).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes);
        Some(match *b.first()? {
            1 => Command::Echo(b[1..].to_vec()),
            2 => Command::Checksum { segment: *b.get(1)? != 0, offset: u64_at(2)?, len: u64_at(10)? },
            3 => Command::Protect { offset: u64_at(1)?, len: u64_at(9)? },
            4 => Command::Unprotect,
            5 => Command::Read64 { segment: *b.get(1)? != 0, offset: u64_at(2)? },
            6 => Command::Exit,
            _ => return None,
        })
    }
}

/// A reply from the peer (echo replies are the echoed bytes themselves).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Ok,
    Checksum(u64),
    Value(u64),
    /// A write-with-immediate arrived: its immediate and length.
    Imm(u32, u32),
}

impl Reply {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        match self {
            Reply::Ok => v.push(1),
            Reply::Checksum(c) => {
                v.push(2);
                v.extend_from_slice(&c.to_le_bytes());
            }
            Reply::Value(c) => {
                v.push(3);
                v.extend_from_slice(&c.to_le_bytes());
            }
            Reply::Imm(imm, len) => {
                v.push(4);
                v.extend_from_slice(&imm.to_le_bytes());
                v.extend_from_slice(&len.to_le_bytes());
            }
        }
        v
    }
    pub fn decode(b: &[u8]) -> Option<Reply> {
        Some(match *b.first()? {
            1 => Reply::Ok,
            2 => Reply::Checksum(u64::from_le_bytes(b.get(1..9)?.try_into().ok()?)),
            3 => Reply::Value(u64::from_le_bytes(b.get(1..9)?.try_into().ok()?)),
            4 => Reply::Imm(
                u32::from_le_bytes(b.get(1..5)?.try_into().ok()?),
                u32::from_le_bytes(b.get(5..9)?.try_into().ok()?),
            ),
            _ => return None,
        })
    }
}

/// FNV-1a, 64 bits.
pub fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ x as u64).wrapping_mul(0x0100_0000_01b3))
}
