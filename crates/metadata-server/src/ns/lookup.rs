//! The read-only operations ([`Reader`]), on any view of the tables.

use super::*;

impl<I, D, C, E, X> Reader for Tables<I, D, C, E, X>
where
    I: ReadableTable<u64, &'static [u8]>,
    D: ReadableTable<(u64, &'static [u8]), (u64, u64, u8)>,
    C: ReadableTable<(u64, u64), &'static [u8]>,
    E: ReadableTable<u64, &'static [u8]>,
    X: ReadableTable<(u64, &'static [u8]), &'static [u8]>,
{
    fn lookup(&self, block_size: u32, r: &EntryRequest) -> Result<Attr, OpError> {
        searchable(self, &r.cred, r.parent)?;
        let (child, _, _) = self
            .dirent(r.parent, r.name.as_bytes())?
            .ok_or(OpError::Fs(FsError::NotFound))?;
        self.read_attr(child, block_size)
    }

    fn getattr(&self, block_size: u32, ino: InodeId) -> Result<Attr, OpError> {
        self.read_attr(ino, block_size)
    }

    fn readlink(&self, ino: InodeId) -> Result<Vec<u8>, OpError> {
        let rec = self.inode(ino)?;
        if rec.kind != FileType::Symlink {
            return err(FsError::NotSymlink);
        }
        Ok(rec.target)
    }

    fn readdir(&self, block_size: u32, r: &ReadDirRequest) -> Result<ReadDirReply, OpError> {
        let dir = self.inode(r.inode)?;
        if !dir.is_dir() {
            return err(FsError::NotDir);
        }
        check(&r.cred, &dir, MAY_READ)?;
        let from = r.cookie.saturating_add(1).max(FIRST_DIR_COOKIE);
        let max = r
            .max_entries
            .clamp(1, sanfs_proto::model::MAX_READDIR_ENTRIES) as usize;
        let mut entries = Vec::new();
        let mut eof = true;
        for item in self
            .cookies
            .range((r.inode.0, from)..=(r.inode.0, u64::MAX))?
        {
            let (key, name) = item?;
            if entries.len() == max {
                eof = false;
                break;
            }
            let cookie = key.value().1;
            let name = name.value().to_vec();
            let (child, _, kind) = self.dirent(r.inode, &name)?.ok_or_else(|| {
                crate::store::corrupt(
                    format_args!("directory {}", r.inode.0),
                    format_args!("cookie {cookie} names a missing entry"),
                )
            })?;
            let attr = if r.plus {
                Some(self.read_attr(child, block_size)?)
            } else {
                None
            };
            let name = FileName::new(name)
                .map_err(|e| crate::store::corrupt(format_args!("directory {}", r.inode.0), e))?;
            entries.push(DirEntry {
                name,
                inode: child,
                kind,
                cookie,
                attr,
            });
        }
        Ok(ReadDirReply {
            entries,
            eof,
            parent: InodeId(dir.parent),
        })
    }

    fn getxattr(&self, r: &XattrRequest) -> Result<Vec<u8>, OpError> {
        let rec = self.inode(r.inode)?;
        xattr_access(&r.cred, &rec, r.name.as_bytes(), false)?;
        self.xattr(r.inode, r.name.as_bytes())?
            .ok_or(OpError::Fs(FsError::NoAttr))
    }

    fn listxattr(&self, cred: &Credentials, ino: InodeId) -> Result<Vec<Vec<u8>>, OpError> {
        self.inode(ino)?;
        let mut names = Vec::new();
        for item in self.xattrs.range((ino.0, &[][..])..)? {
            let (k, _) = item?;
            let (owner, name) = k.value();
            if owner != ino.0 {
                break;
            }
            if name.starts_with(b"trusted.") && !cred.is_root() {
                continue;
            }
            names.push(name.to_vec());
        }
        Ok(names)
    }

    fn access(&self, cred: &Credentials, ino: InodeId, mask: u32) -> Result<(), OpError> {
        let rec = self.inode(ino)?;
        check(cred, &rec, mask & 7)
    }

    fn extent_list(&self, ino: InodeId) -> Result<Vec<Extent>, OpError> {
        self.inode(ino)?;
        self.extents(ino)
    }
}

/// The read-only operations, on any view of the tables.
pub trait Reader {
    fn lookup(&self, block_size: u32, r: &EntryRequest) -> Result<Attr, OpError>;
    fn getattr(&self, block_size: u32, ino: InodeId) -> Result<Attr, OpError>;
    fn readlink(&self, ino: InodeId) -> Result<Vec<u8>, OpError>;
    fn readdir(&self, block_size: u32, r: &ReadDirRequest) -> Result<ReadDirReply, OpError>;
    fn getxattr(&self, r: &XattrRequest) -> Result<Vec<u8>, OpError>;
    fn listxattr(&self, cred: &Credentials, ino: InodeId) -> Result<Vec<Vec<u8>>, OpError>;
    fn access(&self, cred: &Credentials, ino: InodeId, mask: u32) -> Result<(), OpError>;
    fn extent_list(&self, ino: InodeId) -> Result<Vec<Extent>, OpError>;
}
