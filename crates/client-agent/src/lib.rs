//! `sanfs-agent`: the client side of the direct path. Not built yet (issue 5).
