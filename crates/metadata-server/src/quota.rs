//! Directory quotas (what a CSI volume is): a directory can carry a capacity in bytes and
//! optionally a number of inodes. Everything created below it is charged to it (as XFS
//! project quotas with inheritance): each inode records its quota directory (`project`),
//! set at creation from its parent, and the `quotas` table keeps each quota's limits and its
//! exact usage, changed in the same transaction as the allocation, free, create or destroy
//! that caused it.
//!
//! Rules:
//! - A change that would take a quota past a limit fails with EDQUOT and changes nothing
//!   (checked before anything changes); frees always succeed.
//! - Renames and hard links across quotas answer EXDEV (`mv` then copies), so that usage
//!   never has to move between quotas.
//! - A quota is set on an empty directory that is in no quota (no nesting), by root; setting
//!   it again changes the limits (also below the usage: later growth then fails).
//! - Usage counts allocated blocks (not the size) and inodes below the directory, not the
//!   directory itself.

use redb::ReadableTable;
use sanfs_proto::model::{QuotaInfo, QuotaLimits};
use sanfs_proto::types::{Credentials, FsError, InodeId};

use crate::store::records::InodeRec;
use crate::store::{Ctx, OpError, QUOTAS, Store, open_if_exists, read_tables};

/// "No limit" in the table.
const NONE: u64 = u64::MAX;

/// One quota: limits and usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaRow {
    pub limit_bytes: Option<u64>,
    pub limit_inodes: Option<u64>,
    pub used_blocks: u64,
    pub used_inodes: u64,
}

impl QuotaRow {
    pub fn from_tuple((b, i, ub, ui): (u64, u64, u64, u64)) -> QuotaRow {
        QuotaRow {
            limit_bytes: (b != NONE).then_some(b),
            limit_inodes: (i != NONE).then_some(i),
            used_blocks: ub,
            used_inodes: ui,
        }
    }

    pub fn to_tuple(self) -> (u64, u64, u64, u64) {
        (
            self.limit_bytes.unwrap_or(NONE),
            self.limit_inodes.unwrap_or(NONE),
            self.used_blocks,
            self.used_inodes,
        )
    }

    pub fn info(&self, dir: u64, block_size: u32) -> QuotaInfo {
        QuotaInfo {
            inode: InodeId(dir),
            limits: QuotaLimits {
                capacity_bytes: self.limit_bytes,
                inodes: self.limit_inodes,
            },
            used_bytes: self.used_blocks.saturating_mul(u64::from(block_size)),
            used_inodes: self.used_inodes,
        }
    }
}

fn row(ctx: &Ctx<'_>, project: u64) -> Result<Option<QuotaRow>, OpError> {
    Ok(ctx
        .quotas
        .get(project)?
        .map(|v| QuotaRow::from_tuple(v.value())))
}

/// The quota that children of directory `dir` are charged to.
pub fn child_project(ctx: &Ctx<'_>, dir: u64, dir_rec: &InodeRec) -> Result<u64, OpError> {
    if ctx.quotas.get(dir)?.is_some() {
        Ok(dir)
    } else {
        Ok(dir_rec.project)
    }
}

/// Fails with EDQUOT if charging `blocks` and `inodes` more to `project` passes a limit.
pub fn check(ctx: &Ctx<'_>, project: u64, blocks: u64, inodes: u64) -> Result<(), OpError> {
    if project == 0 {
        return Ok(());
    }
    let Some(q) = row(ctx, project)? else {
        return Ok(());
    };
    let bs = u64::from(ctx.block_size);
    if let Some(limit) = q.limit_bytes
        && blocks > 0
        && q.used_blocks.saturating_add(blocks).saturating_mul(bs) > limit
    {
        return Err(OpError::Fs(FsError::QuotaExceeded));
    }
    if let Some(limit) = q.limit_inodes
        && inodes > 0
        && q.used_inodes.saturating_add(inodes) > limit
    {
        return Err(OpError::Fs(FsError::QuotaExceeded));
    }
    Ok(())
}

/// Changes `project`'s usage by `blocks` and `inodes` (after [`check`] for growth).
pub fn apply(ctx: &mut Ctx<'_>, project: u64, blocks: i64, inodes: i64) -> Result<(), OpError> {
    if project == 0 || (blocks == 0 && inodes == 0) {
        return Ok(());
    }
    let Some(mut q) = row(ctx, project)? else {
        return Ok(());
    };
    q.used_blocks = q.used_blocks.saturating_add_signed(blocks);
    q.used_inodes = q.used_inodes.saturating_add_signed(inodes);
    ctx.quotas.insert(project, q.to_tuple())?;
    Ok(())
}

/// Sets (or changes) the quota of directory `dir`.
pub fn set(
    ctx: &mut Ctx<'_>,
    cred: &Credentials,
    dir: u64,
    limits: &QuotaLimits,
) -> Result<QuotaInfo, OpError> {
    if !cred.is_root() {
        return Err(OpError::Fs(FsError::Perm));
    }
    let rec = ctx.t.inode(InodeId(dir))?;
    if !rec.is_dir() {
        return Err(OpError::Fs(FsError::NotDir));
    }
    let q = match row(ctx, dir)? {
        Some(q) => QuotaRow {
            limit_bytes: limits.capacity_bytes,
            limit_inodes: limits.inodes,
            ..q
        },
        None => {
            if rec.size != 0 {
                return Err(OpError::Fs(FsError::Invalid(
                    "a quota is set on an empty directory".into(),
                )));
            }
            if rec.project != 0 {
                return Err(OpError::Fs(FsError::Invalid(format!(
                    "the directory is inside the quota of directory {}: quotas do not nest",
                    rec.project
                ))));
            }
            QuotaRow {
                limit_bytes: limits.capacity_bytes,
                limit_inodes: limits.inodes,
                used_blocks: 0,
                used_inodes: 0,
            }
        }
    };
    ctx.quotas.insert(dir, q.to_tuple())?;
    Ok(q.info(dir, ctx.block_size))
}

/// Every directory quota (`(directory, row)`, by directory inode): for ListQuotas.
pub fn list(store: &Store) -> Result<Vec<(u64, QuotaRow)>, FsError> {
    store.snapshot(|r| {
        let Some(quotas) = open_if_exists(r, QUOTAS)? else {
            return Ok(Vec::new());
        };
        let mut all = Vec::new();
        for entry in quotas.iter()? {
            let (k, v) = entry?;
            all.push((k.value(), QuotaRow::from_tuple(v.value())));
        }
        Ok(all)
    })
}

/// The quota an inode is charged to, with its limits and usage (for statfs inside it and
/// GetQuota): `(quota directory, row)`; a quota directory is its own quota.
pub fn quota_of(store: &Store, ino: u64) -> Result<Option<(u64, QuotaRow)>, FsError> {
    store.snapshot(|r| {
        let rec = read_tables(r)?.inode(InodeId(ino))?;
        let Some(quotas) = open_if_exists(r, QUOTAS)? else {
            return Ok(None);
        };
        for project in [ino, rec.project] {
            if project == 0 {
                continue;
            }
            if let Some(v) = quotas.get(project)? {
                return Ok(Some((project, QuotaRow::from_tuple(v.value()))));
            }
        }
        Ok(None)
    })
}
