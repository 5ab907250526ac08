//! `S3Config::from_env` loads the credentials once per process: a command that opens S3
//! twice (a copy from S3 to S3, a writer and its abort, a resume) runs a profile's
//! `credential_process` (which may prompt for an MFA code) once. Its own test binary,
//! since it sets the process's environment.

use ferry_s3::S3Config;

#[cfg(unix)]
#[test]
fn credential_process_runs_once_per_process() {
    use std::os::unix::fs::PermissionsExt;
    let home = tempfile::tempdir().unwrap();
    let (script, count) = (home.path().join("creds.sh"), home.path().join("count"));
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho run >> '{}'\nprintf '{{\"Version\": 1, \"AccessKeyId\": \"ONCEKEY\", \
             \"SecretAccessKey\": \"s\"}}'\n",
            count.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = home.path().join("config");
    std::fs::write(&config, format!("[profile once]\ncredential_process = {}\n", script.display())).unwrap();
    for v in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"] {
        std::env::remove_var(v);
    }
    std::env::set_var("HOME", home.path());
    std::env::set_var("AWS_CONFIG_FILE", &config);
    std::env::set_var("AWS_SHARED_CREDENTIALS_FILE", home.path().join("none"));
    std::env::set_var("AWS_PROFILE", "once");
    std::env::set_var("AWS_EC2_METADATA_DISABLED", "true");
    for _ in 0..3 {
        assert_eq!(S3Config::from_env().unwrap().access_key_id, "ONCEKEY");
    }
    assert_eq!(std::fs::read_to_string(&count).unwrap(), "run\n", "credential_process ran more than once");
    // S3Config::load, which takes the environment as arguments, is not cached.
    S3Config::load(&|k| std::env::var(k).ok(), Some(home.path())).unwrap();
    assert_eq!(std::fs::read_to_string(&count).unwrap(), "run\nrun\n");
}
