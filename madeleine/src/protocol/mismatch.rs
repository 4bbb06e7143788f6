//! What differs between a message as packed and as unpacked, and how it is told to the sender.

use crate::wire::Modes;

/// What differs between a message as packed and as unpacked: found by the receiver, reported
/// to it as [`MadError::Mismatch`] and to the sender, out of band, as a pipe notice (see
/// [`Mismatch::words`]), which the sender's next `begin_packing` to that rank returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mismatch {
    /// The receiver asked for more packs than the sender packed.
    ExtraUnpack { packs: u32 },
    /// The receiver unpacked fewer packs than the sender packed.
    Count { packs: u32, unpacks: u32 },
    /// Pack `pack` was `sent` bytes, unpacked into `asked`.
    Size { pack: u32, sent: u64, asked: u64 },
    /// Pack `pack` was sent with other modes than unpacked.
    Modes { pack: u32, sent: Modes, asked: Modes },
}

impl Mismatch {
    pub(crate) fn describe(&self) -> String {
        match *self {
            Mismatch::ExtraUnpack { packs } => format!("the sender packed {packs} items, the receiver asked for more"),
            Mismatch::Count { packs, unpacks } => {
                format!("the sender packed {packs} items, the receiver unpacked {unpacks}")
            }
            Mismatch::Size { pack, sent, asked } => format!("pack {pack} has {sent} bytes, unpacked into {asked}"),
            Mismatch::Modes { pack, sent, asked } => format!("pack {pack} was sent {sent:?}, unpacked {asked:?}"),
        }
    }

    /// The notice's first words: kind and pack, what was sent, what was asked.
    pub(crate) fn words(&self) -> [u64; 3] {
        let (kind, pack, sent, asked) = match *self {
            Mismatch::ExtraUnpack { packs } => (1, 0, packs as u64, 0),
            Mismatch::Count { packs, unpacks } => (2, 0, packs as u64, unpacks as u64),
            Mismatch::Size { pack, sent, asked } => (3, pack, sent, asked),
            Mismatch::Modes { pack, sent, asked } => (4, pack, sent.code() as u64, asked.code() as u64),
        };
        [kind << 32 | pack as u64, sent, asked]
    }

    /// The mismatch a notice's words describe (None if they are not one: a bad peer).
    pub(crate) fn from_words(w: [u64; 3]) -> Option<Mismatch> {
        let (kind, pack) = (w[0] >> 32, w[0] as u32);
        let modes = |x: u64| u8::try_from(x).ok().and_then(Modes::from_code);
        Some(match kind {
            1 => Mismatch::ExtraUnpack { packs: u32::try_from(w[1]).ok()? },
            2 => Mismatch::Count { packs: u32::try_from(w[1]).ok()?, unpacks: u32::try_from(w[2]).ok()? },
            3 => Mismatch::Size { pack, sent: w[1], asked: w[2] },
            4 => Mismatch::Modes { pack, sent: modes(w[1])?, asked: modes(w[2])? },
            _ => return None,
        })
    }
}
