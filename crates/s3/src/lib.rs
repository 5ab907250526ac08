//! S3 objects as ferry backends: reads through `ferry-http` (presigned ranged GETs),
//! writes as parallel multipart uploads. The implementation is filled in next.
