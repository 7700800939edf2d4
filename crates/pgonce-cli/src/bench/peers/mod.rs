//! Job queues from crates.io, driven through the same claim-to-complete work
//! as pgonce's variants, on the same database, in the same run.

pub mod sqlxmq;
