//! One metrics endpoint per node (`sanfs-csi --metrics ADDR`): the driver's own metrics and
//! those of every agent it runs, each agent's samples labelled `volume="ID"`.
//!
//! Under CSI every staged volume has an agent of its own, so a `metrics=` port in the agents'
//! options would be taken by the first volume and fail the second. Instead the driver asks
//! each agent for its metrics over the agent's control socket (`{"op":"metrics"}`, the
//! [`crate::control`] socket named by the mount's device number), at each scrape: no port per
//! agent. The agents are found in the mount table: the sanfs mounts whose source is
//! `SERVER:/ROOT/ID` of this driver (a volume published to several pods is one mount, one
//! agent; bind mounts share its device number).
//!
//! | metric | kind | labels | meaning |
//! |---|---|---|---|
//! | `sanfs_csi_build_info` | gauge | `version` | always 1 |
//! | `sanfs_csi_server_session` | gauge | | 1 when the driver's session at the server is open and its lease valid |
//! | `sanfs_csi_volumes_staged` | gauge | | volumes with an agent on this node |
//! | `sanfs_csi_agent_up` | gauge | `volume` | 1 when the volume's agent answered this scrape |
//! | `sanfs_agent_*` | | `volume` + the agent's own | every agent metric (`crate::metrics`) |
//!
//! Families are merged: each `# HELP` and `# TYPE` appears once, followed by the samples of
//! every agent, as the text format requires.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use crate::control::{self, Request};

use super::Driver;

/// How long one agent may take to answer a scrape (the agents are asked at once).
const AGENT_TIMEOUT: Duration = Duration::from_secs(3);

/// One agent of this driver: its volume and its control socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeAgent {
    pub volume: String,
    pub socket: PathBuf,
}

/// The agents of `driver`'s volumes on this node, one per mount (by device number), sorted
/// by volume id.
pub fn volume_agents(driver: &Driver) -> Vec<VolumeAgent> {
    let prefix = driver.mount_source("");
    let run_dir = control::run_dir();
    let mut by_device: BTreeMap<(u32, u32), String> = BTreeMap::new();
    for m in control::fuse_mounts().unwrap_or_default() {
        if let Some(id) = m.source.strip_prefix(&prefix)
            && !id.is_empty()
            && !id.contains('/')
        {
            by_device.insert((m.major, m.minor), id.to_owned());
        }
    }
    let mut agents: Vec<VolumeAgent> = by_device
        .into_iter()
        .map(|((major, minor), volume)| VolumeAgent {
            volume,
            socket: control::socket_path(&run_dir, major, minor),
        })
        .collect();
    agents.sort_by(|a, b| a.volume.cmp(&b.volume));
    agents
}

/// The node's whole exposition: the driver's metrics, then every agent's, merged.
pub fn render(driver: &Driver) -> String {
    let agents = volume_agents(driver);
    let answers: Vec<(String, Option<String>)> = std::thread::scope(|s| {
        let asks: Vec<_> = agents
            .iter()
            .map(|a| {
                s.spawn(move || {
                    match control::ask_within(&a.socket, &Request::Metrics, AGENT_TIMEOUT) {
                        Ok(r) => r.metrics,
                        Err(e) => {
                            tracing::debug!(volume = %a.volume, error = %e, "agent metrics");
                            None
                        }
                    }
                })
            })
            .collect();
        agents
            .iter()
            .zip(asks)
            .map(|(a, h)| (a.volume.clone(), h.join().ok().flatten()))
            .collect()
    });
    let session = driver.client().ok().is_some_and(|c| c.session().1);
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, samples: &[(String, f64)]| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (labels, v) in samples {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
        out.push('\n');
    };
    gauge(
        "sanfs_csi_build_info",
        "Always 1; the label says which sanfs-csi version serves.",
        &[(
            format!("{{version=\"{}\"}}", env!("CARGO_PKG_VERSION")),
            1.0,
        )],
    );
    gauge(
        "sanfs_csi_server_session",
        "1 when the driver's session at the metadata server is open and its lease valid.",
        &[(String::new(), if session { 1.0 } else { 0.0 })],
    );
    gauge(
        "sanfs_csi_volumes_staged",
        "Volumes with an agent (a staging mount) on this node.",
        &[(String::new(), agents.len() as f64)],
    );
    let up: Vec<(String, f64)> = answers
        .iter()
        .map(|(v, text)| {
            (
                format!("{{volume=\"{}\"}}", escape(v)),
                if text.is_some() { 1.0 } else { 0.0 },
            )
        })
        .collect();
    gauge(
        "sanfs_csi_agent_up",
        "1 when the volume's agent answered this scrape over its control socket.",
        &up,
    );
    let answered: Vec<(&str, &str)> = answers
        .iter()
        .filter_map(|(v, t)| t.as_deref().map(|t| (v.as_str(), t)))
        .collect();
    out.push_str(&merge(&answered));
    out
}

/// A label value escaped for the text format.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A sample line with `volume="ID"` added as its first label.
fn relabel(line: &str, volume: &str) -> String {
    let label = format!("volume=\"{}\"", escape(volume));
    let name_end = line.find([' ', '{']).unwrap_or(line.len());
    let (name, rest) = line.split_at(name_end);
    match rest.strip_prefix('{') {
        Some(labels) if labels.starts_with('}') => format!("{name}{{{label}{labels}"),
        Some(labels) => format!("{name}{{{label},{labels}"),
        None => format!("{name}{{{label}}}{rest}"),
    }
}

/// One metric family gathered from several expositions.
#[derive(Default)]
struct Family {
    help: Option<String>,
    kind: Option<String>,
    samples: Vec<String>,
}

/// The family `name`, made (and put last in `order`) when new.
fn family<'a>(
    families: &'a mut HashMap<String, Family>,
    order: &mut Vec<String>,
    name: &str,
) -> &'a mut Family {
    if !families.contains_key(name) {
        order.push(name.to_owned());
    }
    families.entry(name.to_owned()).or_default()
}

/// Merges expositions `(volume, text)` into one: each family once (its first `# HELP` and
/// `# TYPE`), with the samples of every exposition labelled by their volume.
pub fn merge(expositions: &[(&str, &str)]) -> String {
    let mut order: Vec<String> = Vec::new();
    let mut families: HashMap<String, Family> = HashMap::new();
    for (volume, text) in expositions {
        // The family the last # TYPE or # HELP named (a histogram's samples carry suffixes).
        let mut current = String::new();
        for line in text.lines() {
            let described = line
                .strip_prefix("# HELP ")
                .map(|r| (true, r))
                .or_else(|| line.strip_prefix("# TYPE ").map(|r| (false, r)));
            if let Some((help, rest)) = described {
                let name = rest.split(' ').next().unwrap_or_default();
                current = name.to_owned();
                let f = family(&mut families, &mut order, name);
                let slot = if help { &mut f.help } else { &mut f.kind };
                slot.get_or_insert_with(|| line.to_owned());
                continue;
            }
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let name = &line[..line.find([' ', '{']).unwrap_or(line.len())];
            let of_current = name
                .strip_prefix(current.as_str())
                .is_some_and(|s| ["", "_bucket", "_sum", "_count"].contains(&s));
            let owner = if of_current && !current.is_empty() {
                current.clone()
            } else {
                name.to_owned()
            };
            family(&mut families, &mut order, &owner)
                .samples
                .push(relabel(line, volume));
        }
    }
    let mut out = String::new();
    for name in order {
        let Some(f) = families.get(&name) else {
            continue;
        };
        for l in [&f.help, &f.kind].into_iter().flatten() {
            out.push_str(l);
            out.push('\n');
        }
        for s in &f.samples {
            out.push_str(s);
            out.push('\n');
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_get_the_volume_as_their_first_label() {
        assert_eq!(relabel("a_total 3", "v1"), "a_total{volume=\"v1\"} 3");
        assert_eq!(
            relabel("a_total{op=\"read\"} 3", "v1"),
            "a_total{volume=\"v1\",op=\"read\"} 3"
        );
        assert_eq!(relabel("a{} 1", "v\"2"), "a{volume=\"v\\\"2\"} 1");
    }

    #[test]
    fn families_of_several_agents_appear_once_with_every_agents_samples() {
        let one = "# HELP x_total Things.\n# TYPE x_total counter\nx_total{op=\"r\"} 1\n\n\
                   # TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_sum 0.5\nh_count 2\n";
        let two = "# TYPE h histogram\nh_bucket{le=\"1\"} 7\nh_sum 1\nh_count 7\n\n\
                   # HELP x_total Things.\n# TYPE x_total counter\nx_total{op=\"r\"} 5\n";
        let m = merge(&[("a", one), ("b", two)]);
        assert_eq!(
            m,
            "# HELP x_total Things.\n# TYPE x_total counter\n\
             x_total{volume=\"a\",op=\"r\"} 1\nx_total{volume=\"b\",op=\"r\"} 5\n\n\
             # TYPE h histogram\nh_bucket{volume=\"a\",le=\"1\"} 2\nh_sum{volume=\"a\"} 0.5\n\
             h_count{volume=\"a\"} 2\nh_bucket{volume=\"b\",le=\"1\"} 7\nh_sum{volume=\"b\"} 1\n\
             h_count{volume=\"b\"} 7\n\n"
        );
        assert_eq!(m.matches("# TYPE").count(), 2);
    }
}
