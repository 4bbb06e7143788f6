//! Settings from the environment, read one way everywhere: an unset (or empty) variable is
//! `None`; a set one that does not parse is an error naming the variable and what it takes,
//! never silently ignored. Every variable the stack reads is listed in `docs/CONFIG.md`.

use std::str::FromStr;

use crate::error::{Result, VerbsError};

/// The value of `name` parsed as a `T`; `what` says what it takes (for the error).
pub fn parse<T: FromStr>(name: &str, what: &str) -> Result<Option<T>> {
    let Some(raw) = text(name)? else { return Ok(None) };
    raw.parse().map(Some).map_err(|_| VerbsError::invalid(format!("{name}={raw:?}: expected {what}")))
}

/// The trimmed text of `name`, if set and not empty (a value that is not UTF-8 is an error).
pub fn text(name: &str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Ok(Some(v.trim().to_owned())),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(VerbsError::invalid(format!("{name} is not UTF-8"))),
    }
}

/// Whether `name` is set to a true value (`1`, `true`, `yes`, `on`); unset is `default`;
/// anything else is an error.
pub fn flag(name: &str, default: bool) -> Result<bool> {
    match text(name)?.as_deref().map(str::to_ascii_lowercase).as_deref() {
        None => Ok(default),
        Some("1" | "true" | "yes" | "on") => Ok(true),
        Some("0" | "false" | "no" | "off") => Ok(false),
        Some(v) => Err(VerbsError::invalid(format!("{name}={v:?}: expected 1 or 0"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_and_empty_are_none_and_a_bad_value_names_the_variable() {
        std::env::set_var("PV_TEST_ENV_A", " 42 ");
        assert_eq!(parse::<u32>("PV_TEST_ENV_A", "a count").unwrap(), Some(42));
        std::env::set_var("PV_TEST_ENV_A", "");
        assert_eq!(parse::<u32>("PV_TEST_ENV_A", "a count").unwrap(), None);
        assert_eq!(parse::<u32>("PV_TEST_ENV_UNSET", "a count").unwrap(), None);
        std::env::set_var("PV_TEST_ENV_A", "4x");
        let e = parse::<u32>("PV_TEST_ENV_A", "a count").unwrap_err().to_string();
        assert!(e.contains("PV_TEST_ENV_A") && e.contains("a count"), "{e}");
        std::env::set_var("PV_TEST_ENV_A", "On");
        assert!(flag("PV_TEST_ENV_A", false).unwrap());
        std::env::set_var("PV_TEST_ENV_A", "maybe");
        assert!(flag("PV_TEST_ENV_A", false).is_err());
        std::env::remove_var("PV_TEST_ENV_A");
        assert!(!flag("PV_TEST_ENV_A", false).unwrap());
    }
}
