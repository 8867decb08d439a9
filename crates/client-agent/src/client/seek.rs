//! `lseek(SEEK_DATA / SEEK_HOLE)`: where a file's data and holes are, from its extent map.
//!
//! Written extents are data; holes and Unwritten extents (allocated, never written: they read
//! as zeros) are holes, as XFS reports them when no dirty page cache covers them (and sanfs
//! has no client cache). The end of file is a hole.

use sanfs_proto::model::{ExtentState, GetExtentsReply, GetExtentsRequest};
use sanfs_proto::pb;
use sanfs_proto::types::{ByteRange, Credentials, FsError, InodeId, MAX_FILE_SIZE};

use super::rpc::Pin;
use super::{Client, Inner};

/// Which lseek.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeekWhat {
    Data,
    Hole,
}

/// The answer to SEEK_DATA or SEEK_HOLE from `offset` over written byte ranges (sorted, not
/// overlapping) of a file of `size` bytes; `None` is ENXIO (`offset` at or past the end, or no
/// data after it).
pub fn seek_in(written: &[(u64, u64)], size: u64, offset: u64, what: SeekWhat) -> Option<u64> {
    if offset >= size {
        return None;
    }
    match what {
        SeekWhat::Data => written
            .iter()
            .find(|(start, end)| *end > offset && *start < size)
            .map(|(start, _)| (*start).max(offset)),
        SeekWhat::Hole => {
            let mut pos = offset;
            for (start, end) in written {
                if *start > pos {
                    break;
                }
                pos = pos.max(*end);
            }
            Some(pos.min(size))
        }
    }
}

impl Client {
    /// SEEK_DATA or SEEK_HOLE from `offset` in `ino` (`None`: ENXIO).
    pub async fn seek(
        &self,
        cred: &Credentials,
        ino: InodeId,
        offset: u64,
        what: SeekWhat,
    ) -> Result<Option<u64>, FsError> {
        self.write_back_barrier(ino).await;
        self.inner.settle(ino).await;
        let from = offset.min(MAX_FILE_SIZE - 1);
        let req = GetExtentsRequest {
            cred: cred.clone(),
            inode: ino,
            range: ByteRange::new(from, MAX_FILE_SIZE - from)?,
        };
        let reply = self.inner.get_extents(req).await?;
        let mut written: Vec<(u64, u64)> = reply
            .extents
            .iter()
            .filter(|e| e.state == ExtentState::Written)
            .map(|e| (e.file_range.offset(), e.file_range.end()))
            .collect();
        written.sort_unstable();
        Ok(seek_in(&written, reply.file_size, offset, what))
    }
}

impl Inner {
    /// `Data.GetExtents`.
    pub(crate) async fn get_extents(
        &self,
        req: GetExtentsRequest,
    ) -> Result<GetExtentsReply, FsError> {
        let req = pb::GetExtentsRequest::from(req);
        self.call("GetExtents reply", Pin::Any, |_| {
            let mut data = self.data();
            let req = req.clone();
            async move { data.get_extents(req).await }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SeekWhat::{Data, Hole};

    #[test]
    fn data_and_holes() {
        // Data at [0, 10) and [20, 30) (touching [30, 35)), size 40.
        let w = [(0, 10), (20, 30), (30, 35)];
        assert_eq!(seek_in(&w, 40, 0, Data), Some(0));
        assert_eq!(seek_in(&w, 40, 5, Data), Some(5));
        assert_eq!(seek_in(&w, 40, 10, Data), Some(20));
        assert_eq!(seek_in(&w, 40, 0, Hole), Some(10));
        assert_eq!(seek_in(&w, 40, 12, Hole), Some(12));
        assert_eq!(seek_in(&w, 40, 20, Hole), Some(35));
        assert_eq!(seek_in(&w, 40, 36, Data), None, "no data after 35");
        assert_eq!(seek_in(&w, 40, 36, Hole), Some(36));
        assert_eq!(seek_in(&w, 40, 40, Hole), None, "at the end of file: ENXIO");
        // Blocks past the size (preallocation written then truncated) are not data.
        assert_eq!(seek_in(&[(0, 8192)], 100, 0, Hole), Some(100));
        assert_eq!(seek_in(&[(8192, 12288)], 100, 0, Data), None);
        assert_eq!(seek_in(&[], 0, 0, Data), None);
    }
}
