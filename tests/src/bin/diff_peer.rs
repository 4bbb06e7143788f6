//! The client of the differential harness (`tests::diff`) in a process of its own:
//!
//!     diff_peer <net> <scenario> <addr>
//!
//! prints the client's observations, one a line, then exits (without closing anything
//! explicitly: what the process leaves open is closed by its exit).

fn main() {
    env_logger::init();
    let args: Vec<String> = std::env::args().collect();
    let (Some(net), Some(sc), Ok(addr)) =
        (tests::diff::Net::by_name(&args[1]), tests::diff::Scenario::by_name(&args[2]), args[3].parse())
    else {
        eprintln!("usage: diff_peer <tcp|bsdp|zsdp|azsdp> <scenario> <addr>");
        std::process::exit(2);
    };
    for o in tests::diff::client(net, sc, addr) {
        println!("{o}");
    }
}
